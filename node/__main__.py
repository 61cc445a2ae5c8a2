"""python -m node [--port N --engine.model DIR ...]: a worker that, per request, computes a prompt
and holds its KV for another worker (Prefill), decodes from another worker's KV or serves a request
whole (Decode, with or without a handle): which one is the gateway's choice, not the deployment's."""

import decode.__main__ as decode_service
import prefill.__main__ as prefill_service
from worker.runtime import worker_main


def add_servicers(server, engine, info, metrics) -> None:
    prefill_service.add_servicer(server, engine, info, metrics)
    decode_service.add_servicer(server, engine, info, metrics)


if __name__ == "__main__":
    worker_main("both", [prefill_service.SERVICE_NAME, decode_service.SERVICE_NAME], add_servicers)
