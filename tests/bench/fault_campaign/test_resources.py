"""A process group's usage as the soak samples it: its processes, their descriptors and memory."""

from __future__ import annotations

import os
import subprocess
import sys

from bench.fault_campaign.resources import group_usage


def test_a_group_counts_each_of_its_processes_and_their_open_files(tmp_path):
    before = group_usage(os.getpgrp())
    files = [open(tmp_path / f"f{i}", "w") for i in range(10)]
    try:
        assert group_usage(os.getpgrp()).num_fds == before.num_fds + 10
    finally:
        for file in files:
            file.close()
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"], stdin=subprocess.DEVNULL,
                             stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        during = group_usage(os.getpgrp())
        assert during.num_processes == before.num_processes + 1
        assert during.pss_bytes > before.pss_bytes
    finally:
        child.kill()
        child.wait()
    assert group_usage(os.getpgrp()).num_processes == before.num_processes


def test_a_group_of_its_own_holds_one_process_until_it_ends():
    alone = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"], start_new_session=True)
    try:
        usage = group_usage(alone.pid)
        assert usage.num_processes == 1 and usage.pss_bytes > 0 and usage.num_fds >= 3
    finally:
        alone.kill()
        alone.wait()
    assert group_usage(alone.pid).num_processes == 0
