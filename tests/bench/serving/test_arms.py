"""How the serving benchmark starts its arms' processes (bench/serving/arms.py)."""

import json

from bench.serving.arms import spawned


def test_a_spawned_process_is_read_from_its_own_ready_file_never_an_earlier_runs(tmp_path):
    ready = tmp_path / "proxy.ready.json"
    ready.write_text(json.dumps({"url": "http://127.0.0.1:1"}))   # what the previous repeat's proxy wrote
    write_later = (f"import json, time; time.sleep(0.3); "
                   f"open({str(ready)!r}, 'w').write(json.dumps({{'url': 'http://127.0.0.1:2'}}))")
    with spawned(["-c", write_later + "; time.sleep(30)"], ready, tmp_path / "log") as record:
        assert record["url"] == "http://127.0.0.1:2"
