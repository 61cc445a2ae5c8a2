"""The connector's config as the worker hands it to vLLM: the KV address peers dial is resolved
once (WorkerSettings.kv_address_for_peers), and the connector reads that same address."""

from pdmesh.config import WorkerSettings
from pdmesh.connector.connector import _advertised
from pdmesh.engine import kv_transfer_config


def _extra(*flags: str, kv_port: int = 7001) -> dict:
    settings = WorkerSettings.from_cli(["--role", "prefill", "--engine.model", "m", *flags])
    return kv_transfer_config(settings, kv_port)["kv_connector_extra_config"]


def test_peers_dial_where_the_kv_port_binds_by_default():
    extra = _extra("--kv_host", "10.0.0.5")
    assert _advertised(extra, extra["kv_host"], extra["kv_port"]) == ("10.0.0.5", 7001)


def test_an_advertised_host_and_port_replace_the_bound_ones():
    extra = _extra("--kv_host", "0.0.0.0", "--kv_advertise_host", "prefill", "--kv_advertise_port", "9000")
    assert extra["kv_advertise_address"] == "prefill:9000"
    assert _advertised(extra, extra["kv_host"], extra["kv_port"]) == ("prefill", 9000)
