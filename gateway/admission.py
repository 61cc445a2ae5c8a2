"""How many requests the gateway runs at once: at most `max_in_flight` in all, and at most
`max_per_tenant` of them for any one tenant (API key), so one key cannot hold every slot.

A request holds its slot from admission until its stream ends: a long generation, or a client that
reads its stream slowly (the stream waits for it), holds one for up to the request timeout. Without
a per-tenant bound one key could take every slot that way and shut every other tenant out. The
anonymous tenant (no API keys configured) is every client at once: only `max_in_flight` bounds it.
A request beyond either bound is refused at once with Overloaded (RESOURCE_EXHAUSTED / 429).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterator
from contextlib import contextmanager

from gateway.auth import ANONYMOUS
from pdmesh.errors import Overloaded


class Admission:
    def __init__(self, max_in_flight: int, max_per_tenant: int | None) -> None:
        self._max_in_flight = max_in_flight
        self._max_per_tenant = max_per_tenant
        self.num_in_flight = 0
        self._in_flight_by_tenant: Counter[str] = Counter()   # only tenants with requests in flight

    def in_flight_of(self, tenant: str) -> int:
        return self._in_flight_by_tenant[tenant]

    @property
    def tenants_in_flight(self) -> set[str]:
        return set(self._in_flight_by_tenant)

    @contextmanager
    def admit(self, tenant: str) -> Iterator[None]:
        """Holds one slot of `tenant` for the block; Overloaded at once when either bound is reached."""
        self._check(tenant)
        self.num_in_flight += 1
        self._in_flight_by_tenant[tenant] += 1
        try:
            yield
        finally:
            self.num_in_flight -= 1
            self._in_flight_by_tenant[tenant] -= 1
            if self._in_flight_by_tenant[tenant] == 0:
                del self._in_flight_by_tenant[tenant]

    def _check(self, tenant: str) -> None:
        if self.num_in_flight >= self._max_in_flight:
            raise Overloaded(f"{self.num_in_flight} requests in flight (limit {self._max_in_flight}); retry later")
        limit = self._max_per_tenant
        if limit is not None and tenant != ANONYMOUS and self._in_flight_by_tenant[tenant] >= limit:
            raise Overloaded(f"this API key's tenant has {self._in_flight_by_tenant[tenant]} requests in flight "
                             f"(its limit {limit}); retry later")
