"""A real redis-server on a free loopback port, for tests: started, pinged, stopped."""

from __future__ import annotations

import shutil
import subprocess
import time
from pathlib import Path

import redis

from worker.engine import free_port


class RedisServer:
    def __init__(self, work_dir: Path, password: str | None = None) -> None:
        binary = shutil.which("redis-server")
        if binary is None:
            raise RuntimeError("redis-server is not installed (apt-get install redis-server)")
        self.port = free_port("127.0.0.1")
        self.password = password
        self._work_dir = work_dir
        self._binary = binary
        self._process: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self) -> "RedisServer":
        args = [self._binary, "--port", str(self.port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no",
                "--dir", str(self._work_dir)]
        if self.password:
            args += ["--requirepass", self.password]
        self._process = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        deadline = time.monotonic() + 10
        while True:
            try:
                self.client().ping()
                return self
            except redis.ConnectionError:
                if time.monotonic() > deadline or self._process.poll() is not None:
                    self.stop()
                    raise RuntimeError(f"redis-server did not start on port {self.port}")
                time.sleep(0.05)

    def client(self) -> redis.Redis:
        return redis.Redis(host="127.0.0.1", port=self.port, password=self.password)

    def stop(self) -> None:
        if self._process is not None and self._process.poll() is None:
            self._process.terminate()
            self._process.wait(timeout=10)
        self._process = None

    def restart(self) -> None:
        """Stops and starts on the same port: every key is gone (no persistence)."""
        self.stop()
        self.start()
