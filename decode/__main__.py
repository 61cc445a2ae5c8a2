"""python -m decode [--port N --engine.model DIR ...]: a decode worker process."""

import asyncio
import logging

from decode.servicer import DecodeServicer
from pdmesh.config import WorkerSettings
from pdmesh.v1 import worker_pb2, worker_pb2_grpc
from pdmesh.worker_runtime import run_worker

SERVICE_NAME = worker_pb2.DESCRIPTOR.services_by_name["Decode"].full_name


def main(argv: list[str] | None = None) -> None:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    settings = WorkerSettings.from_cli(argv, role="decode")

    def add_servicer(server, engine, info):
        worker_pb2_grpc.add_DecodeServicer_to_server(DecodeServicer(engine, info), server.server)

    asyncio.run(run_worker(settings, SERVICE_NAME, add_servicer))


if __name__ == "__main__":
    main()
