"""python -m decode [--port N --engine.model DIR ...]: a decode worker process."""

from decode.servicer import DecodeServicer
from pdmesh.v1 import worker_pb2, worker_pb2_grpc
from worker.runtime import worker_main


SERVICE_NAME = worker_pb2.DESCRIPTOR.services_by_name["Decode"].full_name


def add_servicer(server, engine, info, metrics) -> None:
    servicer = DecodeServicer(engine, info, metrics)
    worker_pb2_grpc.add_DecodeServicer_to_server(servicer, server.server)
    server.on_stop.append(servicer.drain)


if __name__ == "__main__":
    worker_main("decode", [SERVICE_NAME], add_servicer)
