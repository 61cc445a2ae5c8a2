"""The registry's Redis client, and the outage log both of its sides keep."""

from __future__ import annotations

import logging

import redis.asyncio as aioredis
from redis.asyncio.retry import Retry
from redis.backoff import NoBackoff

from pdmesh.config import RegistrySettings

logger = logging.getLogger(__name__)

SOCKET_TIMEOUT_S = 1.0       # one Redis call; a beat or a poll never blocks longer than about this


def connect(settings: RegistrySettings, client_name: str = "pdmesh-registry",
            timeout_s: float = SOCKET_TIMEOUT_S) -> aioredis.Redis:
    """An asyncio client for the registry: short timeouts, one immediate retry (a restarted Redis),
    named so that CLIENT LIST shows who holds which connection."""
    if not settings.redis_url:
        raise ValueError("RegistrySettings.redis_url is not set")
    return aioredis.Redis.from_url(settings.redis_url, password=settings.redis_password or None,
                                   socket_timeout=timeout_s, socket_connect_timeout=timeout_s,
                                   retry=Retry(NoBackoff(), 1), client_name=client_name)


class OutageLog:
    """Counts failures; logs the first of an outage and the recovery, not every one."""

    def __init__(self, what: str) -> None:
        self.what = what
        self.num_errors = 0
        self.down = False

    def failed(self, exc: BaseException) -> None:
        self.num_errors += 1
        if not self.down:
            self.down = True
            logger.warning("%s failed (%s: %s); retrying quietly until it works",
                           self.what, type(exc).__name__, exc)

    def succeeded(self) -> None:
        if self.down:
            self.down = False
            logger.info("%s works again", self.what)
