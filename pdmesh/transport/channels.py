"""Sync gRPC channels to peers, one per address (TLS when given credentials), traced by the OTel
client interceptor."""

from __future__ import annotations

import threading

import grpc
from opentelemetry.instrumentation.grpc import client_interceptor
from opentelemetry.instrumentation.grpc.grpcext import intercept_channel

from pdmesh.config import TlsSettings
from pdmesh.tls import channel_credentials
from pdmesh.transport.grpc_options import GRPC_OPTIONS


class ChannelCache:
    def __init__(self, tls: TlsSettings | None = None) -> None:
        self._credentials = channel_credentials(tls) if tls is not None else None  # None: plaintext
        self._lock = threading.Lock()
        self._channels: dict[str, tuple[grpc.Channel, grpc.Channel]] = {}  # address: (raw, traced)

    def get(self, address: str) -> grpc.Channel:
        with self._lock:
            if address not in self._channels:
                channel = (grpc.secure_channel(address, self._credentials, options=GRPC_OPTIONS)
                           if self._credentials is not None else grpc.insecure_channel(address, options=GRPC_OPTIONS))
                self._channels[address] = (channel, intercept_channel(channel, client_interceptor()))
            return self._channels[address][1]

    def close(self) -> None:
        with self._lock:
            for channel, _ in self._channels.values():
                channel.close()
            self._channels.clear()
