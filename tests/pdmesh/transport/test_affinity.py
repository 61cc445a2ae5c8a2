"""CPU lists as the workers' --process_cpus takes them, and pinning a process to one."""

import os
import subprocess
import sys

from pdmesh.transport.affinity import parse_cpus


def test_cpu_lists_parse_as_taskset_writes_them():
    assert parse_cpus("1") == {1}
    assert parse_cpus("0,2-3") == {0, 2, 3}
    assert parse_cpus(" 4-5 , 7") == {4, 5, 7}
    assert parse_cpus("") == set()


def test_a_pinned_process_and_its_children_run_on_its_cpus_only():
    cpu = max(os.sched_getaffinity(0))
    code = ("import os, subprocess, sys; from pdmesh.transport.affinity import pin_process; "
            f"pin_process('{cpu}'); print(subprocess.run([sys.executable, '-c', "
            "'import os; print(sorted(os.sched_getaffinity(0)))'], capture_output=True, text=True).stdout.strip())")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.strip()
    assert out == f"[{cpu}]"
