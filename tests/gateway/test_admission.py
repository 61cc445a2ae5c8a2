"""The gateway's admission (gateway/admission.py): a bound in all and one per tenant."""

from __future__ import annotations

from contextlib import ExitStack

import pytest

from gateway.admission import Admission
from gateway.auth import ANONYMOUS
from pdmesh.errors import Overloaded


def test_a_tenant_at_its_limit_is_refused_while_others_and_the_whole_still_have_room():
    admission = Admission(max_in_flight=3, max_per_tenant=2)
    with ExitStack() as held:
        held.enter_context(admission.admit("a"))
        held.enter_context(admission.admit("a"))
        with pytest.raises(Overloaded, match=r"^this API key's tenant has 2 requests in flight \(its limit 2\)"):
            held.enter_context(admission.admit("a"))
        held.enter_context(admission.admit("b"))
        with pytest.raises(Overloaded, match=r"^3 requests in flight \(limit 3\); retry later$"):
            held.enter_context(admission.admit("c"))
        assert (admission.in_flight_of("a"), admission.in_flight_of("b"), admission.num_in_flight) == (2, 1, 3)
    assert (admission.num_in_flight, admission.tenants_in_flight) == (0, set())


def test_the_anonymous_tenant_is_every_client_and_only_the_whole_bounds_it():
    admission = Admission(max_in_flight=3, max_per_tenant=1)
    with ExitStack() as held:
        for _ in range(3):
            held.enter_context(admission.admit(ANONYMOUS))
        assert admission.num_in_flight == 3


def test_a_slot_is_given_back_when_the_request_fails():
    admission = Admission(max_in_flight=1, max_per_tenant=None)
    with pytest.raises(RuntimeError), admission.admit("a"):
        raise RuntimeError("the request failed")
    assert (admission.num_in_flight, admission.tenants_in_flight) == (0, set())
