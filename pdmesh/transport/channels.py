"""Sync gRPC channels to peers, one per address, traced by the OTel client interceptor."""

from __future__ import annotations

import threading

import grpc
from opentelemetry.instrumentation.grpc import client_interceptor
from opentelemetry.instrumentation.grpc.grpcext import intercept_channel

from pdmesh.transport.grpc_options import GRPC_OPTIONS


class ChannelCache:
    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._channels: dict[str, tuple[grpc.Channel, grpc.Channel]] = {}  # address: (raw, traced)

    def get(self, address: str) -> grpc.Channel:
        with self._lock:
            if address not in self._channels:
                channel = grpc.insecure_channel(address, options=GRPC_OPTIONS)
                self._channels[address] = (channel, intercept_channel(channel, client_interceptor()))
            return self._channels[address][1]

    def close(self) -> None:
        with self._lock:
            for channel, _ in self._channels.values():
                channel.close()
            self._channels.clear()
