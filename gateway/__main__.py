"""python -m gateway --prefill_workers '["host:port"]' --decode_workers '["host:port"]'"""

import asyncio
import logging

from gateway.server import Gateway
from pdmesh.config import GatewaySettings
from pdmesh.gc_heap import freeze_startup_heap
from pdmesh.grpc_server import wait_for_termination_signal, write_ready_file
from pdmesh.telemetry.logs import configure_logging
from pdmesh.telemetry.tracing import setup_tracing, shutdown_tracing


async def serve(settings: GatewaySettings) -> None:
    provider = setup_tracing(settings.telemetry, "pdmesh-gateway")
    gateway = Gateway(settings)
    try:
        address = await gateway.start()
        logger = logging.getLogger("gateway")
        frozen = freeze_startup_heap()   # every stream waits out a full collection: the start-up heap is out of it
        logger.info("gateway serving on %s (HTTP %s, metrics %s); heap: %d objects frozen", address,
                    gateway.http_address or "off", gateway.metrics_address or "off", frozen.num_objects)
        write_ready_file(settings.ready_file, address=address, role="gateway",
                         metrics_address=gateway.metrics_address, http_address=gateway.http_address)
        await wait_for_termination_signal(settings.exit_with_parent)
        await gateway.stop()
    finally:
        shutdown_tracing(provider)


def main(argv: list[str] | None = None) -> None:
    settings = GatewaySettings.from_cli(argv)
    configure_logging(settings.telemetry.log_format)
    asyncio.run(serve(settings))


if __name__ == "__main__":
    main()
