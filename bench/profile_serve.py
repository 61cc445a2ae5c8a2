"""Profiles every process of an arm under one `bench.serve` workload point with py-spy.

python -m bench.profile_serve [--arm pdmesh-1p1d] [--workload long] [--point 3] [--seconds 20]

Starts the system, starts the load, lets it run `--delay-s`, then records each of the system's
processes (gateway, workers' API servers, engine cores, model workers) for `--seconds` at once and
writes one flame graph (SVG) and one top-functions table (speedscope JSON's totals) per process.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

from bench.serving.arms import ARMS, start
from bench.serving.run import measure_point
from bench.serving.workloads import PROFILES
from pdmesh.config import DEFAULT_MODEL_DIR


def _descendants(root_pids: list[int]) -> dict[int, str]:
    """pid: command line of every process under the roots (the roots included)."""
    children: dict[int, list[int]] = {}
    commands: dict[int, str] = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
            ppid = int(stat.rsplit(")", 1)[1].split()[1])
            commands[int(entry.name)] = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode()[:160]
        except OSError:
            continue
        children.setdefault(ppid, []).append(int(entry.name))
    found, todo = {}, list(root_pids)
    while todo:
        pid = todo.pop()
        if pid in commands and pid not in found:
            found[pid] = commands[pid]
            todo += children.get(pid, [])
    return found


def _python_processes(exclude: set[int]) -> dict[int, str]:
    mine = os.getpid()
    roots = [pid for pid, cmd in _descendants([1]).items()
             if pid != mine and pid not in exclude and ("vllm" in cmd or " -m prefill" in cmd or " -m decode" in cmd
                                                          or " -m gateway" in cmd or "VLLM" in cmd)]
    return {pid: cmd for pid, cmd in _descendants(roots).items() if "python" in cmd or "VLLM" in cmd}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--arm", default="pdmesh-1p1d", choices=sorted(ARMS))
    parser.add_argument("--profile", default="full")
    parser.add_argument("--workload", default="long")
    parser.add_argument("--point", type=float, default=None)
    parser.add_argument("--delay-s", type=float, default=5.0)
    parser.add_argument("--seconds", type=int, default=15)
    parser.add_argument("--out", default="bench/results/profile")
    args = parser.parse_args()
    workload = next(w for w in PROFILES[args.profile] if w.name == args.workload)
    point = args.point if args.point is not None else workload.points[-1]
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    before = set(_python_processes(set()))
    with tempfile.TemporaryDirectory() as log_dir, start(ARMS[args.arm], Path(DEFAULT_MODEL_DIR),
                                                          Path(log_dir)) as endpoints:
        processes = _python_processes(before)
        load = threading.Thread(target=measure_point, args=(endpoints.base_url, Path(DEFAULT_MODEL_DIR), workload, point, 900))
        load.start()
        time.sleep(args.delay_s)
        spies = []
        for pid, cmd in processes.items():
            name = f"{pid}"
            spies.append((pid, cmd, subprocess.Popen(
                [str(Path(sys.executable).parent / "py-spy"), "record", "--pid", str(pid), "--duration",
                 str(args.seconds), "--rate", "50", "--idle", "--nonblocking", "--format", "raw", "--output",
                 str(out / f"{name}.txt")], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)))
        for pid, cmd, spy in spies:
            spy.wait()
            print(f"{pid}: {cmd}")
        load.join()
    print(f"raw stacks in {out}/<pid>.txt (python -m bench.profile_top FILE summarizes one)")


if __name__ == "__main__":
    main()
