"""A request's latency targets: its own, else its tenant's, else the gateway's; bad ones refused."""

import pytest

from gateway.slo import RequestSlo, request_slo
from pdmesh.config import GatewaySettings, SloSettings
from pdmesh.errors import InvalidRequest
from pdmesh.v1 import generate_pb2

SETTINGS = GatewaySettings(ttft_slo_s=2.5, tpot_slo_s=0.06,
                           tenant_slos={"chat": SloSettings(ttft_s=1.0, tpot_s=0.025), "batch": SloSettings(tpot_s=0)})


@pytest.mark.parametrize(("tenant", "asked", "slo"), [
    ("anonymous", generate_pb2.Slo(), RequestSlo(2.5, 0.06)),                    # the gateway's
    ("chat", generate_pb2.Slo(), RequestSlo(1.0, 0.025)),                        # the tenant's
    ("batch", generate_pb2.Slo(), RequestSlo(2.5, 0.0)),                         # a tenant without TPOT SLO
    ("chat", generate_pb2.Slo(ttft_s=0.5), RequestSlo(0.5, 0.025)),              # the request's, field by field
    ("anonymous", generate_pb2.Slo(ttft_s=4.0, tpot_s=0.1), RequestSlo(4.0, 0.1)),
])
def test_the_request_asks_first_then_its_tenant_then_the_gateway(tenant, asked, slo):
    assert request_slo(SETTINGS, tenant, asked) == slo


@pytest.mark.parametrize("asked", [generate_pb2.Slo(ttft_s=-1.0), generate_pb2.Slo(tpot_s=float("nan")),
                                   generate_pb2.Slo(ttft_s=float("inf"))])
def test_a_negative_or_non_finite_slo_is_an_invalid_request(asked):
    with pytest.raises(InvalidRequest, match="slo"):
        request_slo(SETTINGS, "anonymous", asked)


def test_tenant_slos_come_from_a_json_flag():
    settings = GatewaySettings.from_cli(["--tenant_slos", '{"chat": {"ttft_s": 1.0, "tpot_s": 0.025}}'])
    assert request_slo(settings, "chat", generate_pb2.Slo()) == RequestSlo(1.0, 0.025)
