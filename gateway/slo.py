"""The latency a request asks for: its own (GenerateRequest.slo, or the OpenAI body's `slo`), else
its tenant's (--tenant_slos), else the deployment's (--ttft_slo_s, --tpot_slo_s). Adaptive placement
weighs options against it; flowing decodes move a stream its TPOT SLO is at risk for."""

from __future__ import annotations

import math
from dataclasses import dataclass

from pdmesh.config import GatewaySettings
from pdmesh.errors import InvalidRequest
from pdmesh.v1 import generate_pb2


@dataclass(frozen=True)
class RequestSlo:
    ttft_s: float
    tpot_s: float   # 0: none (not weighed, never moved)


def request_slo(settings: GatewaySettings, tenant: str, asked: generate_pb2.Slo) -> RequestSlo:
    for name, value in (("ttft_s", asked.ttft_s), ("tpot_s", asked.tpot_s)):
        if not math.isfinite(value) or value < 0:
            raise InvalidRequest(f"slo.{name} must be a number of seconds >= 0 (0: the gateway's), not {value}")
    tenant_slo = settings.tenant_slos.get(tenant)
    ttft_s = asked.ttft_s or (tenant_slo.ttft_s if tenant_slo and tenant_slo.ttft_s is not None
                              else settings.ttft_slo_s)
    tpot_s = asked.tpot_s or (tenant_slo.tpot_s if tenant_slo and tenant_slo.tpot_s is not None
                              else settings.tpot_slo_s)
    return RequestSlo(ttft_s, tpot_s)
