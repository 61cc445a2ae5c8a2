"""python -m prefill [--port N --engine.model DIR ...]: a prefill worker process."""

from pdmesh.v1 import worker_pb2, worker_pb2_grpc
from prefill.servicer import PrefillServicer
from worker.runtime import worker_main


SERVICE_NAME = worker_pb2.DESCRIPTOR.services_by_name["Prefill"].full_name


def add_servicer(server, engine, info, metrics) -> None:
    worker_pb2_grpc.add_PrefillServicer_to_server(PrefillServicer(engine, info, metrics), server.server)


if __name__ == "__main__":
    worker_main("prefill", [SERVICE_NAME], add_servicer)
