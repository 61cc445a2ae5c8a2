"""Where and on what code a report row ran: the commit, whether the working tree differed from it
(and how: a hash of the diff, so two parts run on the same uncommitted change can still be told
apart from two different ones), the machine, and when. A row whose parts or neighbours ran on
other code measures something else: the report refuses to add them up and flags them side by side."""

from __future__ import annotations

import contextlib
import datetime
import hashlib
import os
import platform
import subprocess
from dataclasses import dataclass
from pathlib import Path

REPO_DIR = Path(__file__).resolve().parents[1]
# Pathspecs of what a run writes or what only documents (a report updated between parts is no new code).
NOT_CODE = (".", ":(exclude)bench/report", ":(exclude)bench/results", ":(exclude,glob)**/*.md")


@dataclass(frozen=True)
class RunStamp:
    commit: str     # git rev-parse HEAD ("" outside a git checkout)
    dirty: str      # "" for a clean tree, else 12 hex digits of a sha256 of its code changes against HEAD
    machine: str    # host name, OS and kernel, CPU count
    run_at: str     # UTC, "YYYY-MM-DD HH:MM"

    @property
    def code(self) -> str:
        """The code a row ran: "7e0d607", or "7e0d607+dirty.3fa2c1b0d9e4" for a changed tree."""
        short = self.commit[:7] or "unknown"
        return f"{short}+dirty.{self.dirty}" if self.dirty else short


def run_stamp(repo_dir: Path = REPO_DIR) -> RunStamp:
    return RunStamp(_git(repo_dir, "rev-parse", "HEAD").strip(), _diff_hash(repo_dir), machine(), utc_now())


def machine() -> str:
    """Host, CPU model, the CPUs this process may use and the kernel: two runs compare only on one."""
    return f"{platform.node()} ({cpu_model()}, {len(os.sched_getaffinity(0))} CPUs, {platform.platform()})"


def cpu_model() -> str:
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    return platform.processor() or platform.machine()


def utc_now() -> str:
    return datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M")


def _diff_hash(repo_dir: Path) -> str:
    """The tree's changes against HEAD: tracked files' diff and the untracked (not ignored) files'
    names and contents, leaving out what does not change a run (the reports it writes, prose)."""
    diff = _git(repo_dir, "diff", "HEAD", "--no-ext-diff", "--binary", "--", *NOT_CODE)
    untracked = _git(repo_dir, "ls-files", "--others", "--exclude-standard", "-z", "--", *NOT_CODE)
    digest = hashlib.sha256(diff.encode())
    for name in sorted(filter(None, untracked.split("\0"))):
        digest.update(name.encode() + b"\0")
        with contextlib.suppress(OSError):
            digest.update((repo_dir / name).read_bytes())
    return digest.hexdigest()[:12] if diff or untracked else ""


def _git(repo_dir: Path, *args: str) -> str:
    try:
        return subprocess.run(["git", "-C", str(repo_dir), *args], capture_output=True, text=True,
                              check=True, timeout=30).stdout
    except (OSError, subprocess.SubprocessError):
        return ""
