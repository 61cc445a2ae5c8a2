"""The gateway's side of the layer-wise KV flow (--kv_flow layerwise): decode and prefill start
together on one transfer id minted here, and a prefill failure ends the decode that waits for its KV."""

from __future__ import annotations

import asyncio
import secrets
from collections.abc import AsyncIterator

from gateway.pool import Worker
from pdmesh.compat import tp_size
from pdmesh.v1 import common_pb2, worker_pb2


def layerwise_handle(prefill: Worker, num_tokens: int) -> common_pb2.KVHandle:
    """The handle decode reads a layer-wise transfer with: its id is minted here (unguessable, shared
    by the prefill and decode of one attempt only) and the blocks are named as prefill computes them."""
    info = prefill.info
    return common_pb2.KVHandle(transfer_id=secrets.token_urlsafe(18), kv_address=info.kv_address,
                               num_tokens=num_tokens, compat=info.compat, tp_size=tp_size(info.compat), layerwise=True)


async def until_prefill_fails(chunks: AsyncIterator[worker_pb2.DecodeResponse],
                              prefilling: asyncio.Future) -> AsyncIterator[worker_pb2.DecodeResponse]:
    """decode's chunks, raising prefill's failure as soon as it fails (decode would wait for its
    KV until its own timeout)."""
    iterator = chunks.__aiter__()
    try:
        while True:
            if prefilling.done():  # prefill answered: plain iteration from here
                next_chunk = iterator.__anext__()
            else:
                next_chunk = asyncio.ensure_future(iterator.__anext__())
                await asyncio.wait({next_chunk, prefilling}, return_when=asyncio.FIRST_COMPLETED)
                if prefilling.done() and prefilling.exception() is not None and not next_chunk.done():
                    next_chunk.cancel()  # the decode call is cancelled: its request aborted, blocks freed
                    await asyncio.gather(next_chunk, return_exceptions=True)
                    raise prefilling.exception()
            try:
                yield await next_chunk
            except StopAsyncIteration:
                return
    finally:
        await iterator.aclose()
