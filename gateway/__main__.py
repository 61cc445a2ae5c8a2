"""python -m gateway --prefill_workers '["host:port"]' --decode_workers '["host:port"]'"""

import asyncio
import logging

from gateway.server import Gateway
from pdmesh.config import GatewaySettings
from pdmesh.grpc_server import wait_for_termination_signal, write_ready_file


async def serve(settings: GatewaySettings) -> None:
    gateway = Gateway(settings)
    address = await gateway.start()
    logging.getLogger("gateway").info("gateway serving on %s", address)
    write_ready_file(settings.ready_file, address=address, role="gateway")
    await wait_for_termination_signal()
    await gateway.stop()


def main(argv: list[str] | None = None) -> None:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    asyncio.run(serve(GatewaySettings.from_cli(argv)))


if __name__ == "__main__":
    main()
