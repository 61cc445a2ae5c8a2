import json

from pdmesh.config import GatewaySettings, WorkerSettings


def test_cli_beats_env_beats_file_beats_defaults(tmp_path, monkeypatch):
    config_file = tmp_path / "worker.json"
    config_file.write_text(json.dumps({"port": 1, "hold_timeout_s": 5, "engine": {"block_size": 64}}))
    monkeypatch.setenv("PDMESH_WORKER_CONFIG_FILE", str(config_file))
    monkeypatch.setenv("PDMESH_WORKER_PORT", "2")
    settings = WorkerSettings.from_cli(["--engine.max_model_len", "1024"])
    assert (settings.port, settings.hold_timeout_s) == (2, 5.0)
    assert (settings.engine.block_size, settings.engine.max_model_len) == (64, 1024)
    assert WorkerSettings.from_cli(["--port", "3"]).port == 3


def test_toml_file_and_list_flags(tmp_path):
    config_file = tmp_path / "gw.toml"
    config_file.write_text('prefill_workers = ["a:1", "b:2"]\nport = 7\n')
    settings = GatewaySettings.from_cli(["--config_file", str(config_file), "--decode_workers", '["c:3"]'])
    assert (settings.prefill_workers, settings.decode_workers, settings.port) == (["a:1", "b:2"], ["c:3"], 7)
