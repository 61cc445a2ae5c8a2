"""A mesh peer holding the mesh token that sends a producer's KV port reads of made-up transfer ids
from many threads, each repeating its call (bounded in count and time). It runs as a process of its
own (`python -m tests.pdmesh.transport.kv_port_attackers ADDRESS MODE ...`), as an attacker does: its
threads do not share the measuring test's interpreter lock. It prints "started" once its threads run,
then, as JSON, what its calls raised; KVPortAttackers starts it from a test. Mode "health" is the
control: the same threads and call rate, each call a health check the port answers at once, so a test
can tell a port starved by the reads from one merely sharing its cores with the callers."""

from __future__ import annotations

import argparse
import json
import secrets
import subprocess
import sys
import threading
import time
from collections import Counter

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from decode.kv.kv_port_client import KVPortClient
from pdmesh.transport.mesh_auth import MeshAuth
from pdmesh.v1 import common_pb2

WATCH_WAIT_S = 3.0  # a Watch of an id the producer does not know waits this long for it


class KVPortAttackers:
    """The attackers' process, from the test's side: started, their calls in flight, when constructed."""

    def __init__(self, address: str, mode: str, compat: common_pb2.CompatInfo, mesh_token: str = "",
                 threads: int = 40, seconds: float = 2.0, max_calls: int = 10, pause_s: float = 0.0) -> None:
        self._process = subprocess.Popen(
            [sys.executable, "-m", "tests.pdmesh.transport.kv_port_attackers", address, mode,
             f"--compat_hex={compat.SerializeToString().hex()}", f"--mesh_token={mesh_token}", f"--threads={threads}",
             f"--seconds={seconds}", f"--max_calls={max_calls}", f"--pause_s={pause_s}"],
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        assert self._process.stdout.readline().strip() == "started", self._process.stderr.read()[-3000:]

    def outcome(self, timeout_s: float = 120) -> tuple[int, dict[str, int]]:
        """(calls made, calls by the error they raised), once they are done."""
        stdout, stderr = self._process.communicate(timeout=timeout_s)
        assert self._process.returncode == 0, stderr[-3000:]
        outcome = json.loads(stdout.strip().splitlines()[-1])
        return outcome["calls"], outcome["raised"]

    def stop(self) -> None:
        if self._process.poll() is None:
            self._process.kill()
            self._process.communicate()


def _attack(receiver: KVPortClient, health: health_pb2_grpc.HealthStub, address: str, mode: str) -> None:
    transfer_id = secrets.token_urlsafe(18)
    if mode == "health":
        health.Check(health_pb2.HealthCheckRequest(), timeout=30)
    elif mode == "pull":
        list(receiver.pull(address, transfer_id, [0, 1], verify=False))
    else:
        receiver.watch(address, transfer_id, 0, WATCH_WAIT_S)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("address")
    parser.add_argument("mode", choices=["pull", "watch", "health"])
    parser.add_argument("--compat_hex", required=True)  # the producer's CompatInfo (a peer reads it from WorkerInfo)
    parser.add_argument("--mesh_token", default="")
    parser.add_argument("--threads", type=int, default=40)
    parser.add_argument("--seconds", type=float, default=2.0)
    parser.add_argument("--max_calls", type=int, default=10)
    parser.add_argument("--pause_s", type=float, default=0.0)
    args = parser.parse_args()
    compat = common_pb2.CompatInfo.FromString(bytes.fromhex(args.compat_hex))
    receiver = KVPortClient(compat, timeout_s=30, auth=MeshAuth(args.mesh_token or None))
    channel = grpc.insecure_channel(args.address)
    health = health_pb2_grpc.HealthStub(channel)
    raised: Counter[str] = Counter()
    calls = [0]
    lock = threading.Lock()
    until = time.monotonic() + args.seconds

    def run() -> None:
        for _ in range(args.max_calls):
            if time.monotonic() >= until:
                return
            with lock:
                calls[0] += 1
            try:
                _attack(receiver, health, args.address, args.mode)
            except Exception as exc:  # noqa: BLE001 - counted for the test
                with lock:
                    raised[type(exc).__name__] += 1
            time.sleep(args.pause_s)

    threads = [threading.Thread(target=run) for _ in range(args.threads)]
    for thread in threads:
        thread.start()
    print("started", flush=True)
    for thread in threads:
        thread.join()
    receiver.close()
    channel.close()
    print(json.dumps({"calls": calls[0], "raised": dict(raised)}), flush=True)


if __name__ == "__main__":
    sys.exit(main())
