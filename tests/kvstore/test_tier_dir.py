"""Attacks on the NVMe tier's directory (kvstore/tier_dir.py through the real DiskTier, real files,
a real second process): another user reading the cached prompts' token ids, two workers sharing one
directory, and a tier opened on a directory that holds files not its own."""

from __future__ import annotations

import os
import re
import shutil
import signal
import stat
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np
import pytest

from kvstore.disk_tier import JOURNAL_NAME, MAGIC, SLAB_NAME, TMP_JOURNAL_NAME, DiskTier
from kvstore.tier_dir import LOCK_NAME, TierDirectoryError, TierDirectoryInUse
from tests.kvstore.factories import BLOCK_NBYTES, keys, payload

REPO_ROOT = Path(__file__).resolve().parents[2]
NOBODY = 65534
OWN_FILES = (SLAB_NAME, JOURNAL_NAME, LOCK_NAME)
needs_root = pytest.mark.skipif(os.geteuid() != 0, reason="needs root to act as another user")

HOLDER = """
import sys, time
import numpy as np
from kvstore.disk_tier import DiskTier
from tests.kvstore.factories import BLOCK_NBYTES, keys, payload
tier = DiskTier(sys.argv[1], 4 * BLOCK_NBYTES, BLOCK_NBYTES)
tier.write_many(tier.allocate(1), keys(1), np.frombuffer(payload(7), dtype=np.uint8)[None], [7])
print("ready", flush=True)
time.sleep(600)
"""


def _open(directory: Path) -> DiskTier:
    return DiskTier(directory, 4 * BLOCK_NBYTES, BLOCK_NBYTES)


def _write_one(tier: DiskTier, i: int = 0) -> None:
    tier.write_many(tier.allocate(1), keys(1, first_token=4 * i), np.frombuffer(payload(i), dtype=np.uint8)[None], [i])


def _mode(path: Path) -> int:
    return stat.S_IMODE(os.lstat(path).st_mode)


def _modes_inside(directory: Path) -> dict[str, int]:
    return {path.name: _mode(path) for path in directory.iterdir()}


def _read_as_nobody(path: Path) -> subprocess.CompletedProcess:
    return subprocess.run(["cat", str(path)], user=NOBODY, group=NOBODY, extra_groups=[], capture_output=True)


@pytest.fixture
def open_parent():
    """A directory every user may traverse (pytest's own tmp tree is 0700: it would hide the attack)."""
    path = Path(tempfile.mkdtemp(prefix="pdmesh-tier-dir-"))
    path.chmod(0o755)
    yield path
    shutil.rmtree(path)


@pytest.fixture
def umask(request):
    old = os.umask(request.param)
    yield request.param
    os.umask(old)


@pytest.mark.parametrize("umask", [0o022, 0o000], ids=["umask_022", "umask_000"], indirect=True)
def test_another_user_cannot_read_the_cached_token_ids_whatever_the_umask(open_parent, umask):
    directory = open_parent / "nvme"
    tier = _open(directory)   # the start's journal rewrite made journal.log as its temp copy, then renamed it
    _write_one(tier)
    if os.geteuid() == 0:
        stolen = _read_as_nobody(directory / JOURNAL_NAME)
        assert (stolen.returncode, stolen.stdout) == (1, b"") and b"Permission denied" in stolen.stderr
    assert (_mode(directory), _modes_inside(directory)) == (0o700, dict.fromkeys(OWN_FILES, 0o600))
    tier.close()


def test_a_directory_an_older_tier_left_loose_is_tightened_with_its_files_and_keeps_its_blocks(tmp_path):
    directory = tmp_path / "nvme"
    tier = _open(directory)
    _write_one(tier)
    tier.close()
    directory.chmod(0o755)
    for path in directory.iterdir():
        path.chmod(0o644)
    reopened = _open(directory)
    assert [key for key, _, _ in reopened.recovered()] == keys(1)
    assert (_mode(directory), _modes_inside(directory)) == (0o700, dict.fromkeys(OWN_FILES, 0o600))
    reopened.close()


@needs_root
def test_a_directory_of_another_users_is_refused_untouched(tmp_path):
    directory = tmp_path / "nvme"
    directory.mkdir(mode=0o755)
    os.chown(directory, NOBODY, NOBODY)
    with pytest.raises(TierDirectoryError, match=f"{re.escape(str(directory))} is owned by uid {NOBODY}"):
        _open(directory)
    assert (list(directory.iterdir()), _mode(directory)) == ([], 0o755)


def test_a_shared_sticky_directory_is_refused_and_an_empty_one_a_fresh_mount_is_tightened(tmp_path):
    shared, fresh = tmp_path / "shared", tmp_path / "fresh"
    for directory in (shared, fresh):
        directory.mkdir()
        directory.chmod(0o1777)   # /tmp's mode, and a tmpfs root's
    (shared / "someone-elses.sock").write_bytes(b"")
    with pytest.raises(TierDirectoryError, match=f"{re.escape(str(shared))} is a shared directory"):
        _open(shared)
    assert (sorted(p.name for p in shared.iterdir()), _mode(shared)) == (["someone-elses.sock"], 0o1777)
    _open(fresh).close()
    assert _mode(fresh) == 0o700


def test_a_second_tier_on_the_directory_fails_at_once_naming_it_and_a_restart_after_a_crash_works(tmp_path):
    directory = tmp_path / "nvme"
    worker = subprocess.Popen([sys.executable, "-c", HOLDER, str(directory)], cwd=REPO_ROOT,
                              stdout=subprocess.PIPE, text=True)
    try:
        assert worker.stdout.readline() == "ready\n"
        with pytest.raises(TierDirectoryInUse, match=f"{re.escape(str(directory))} is in use by another KV "
                                                     f"store tier \\(pid {worker.pid} holds"):
            _open(directory)
    finally:
        worker.send_signal(signal.SIGKILL)
        worker.wait()
        worker.stdout.close()
    restarted = _open(directory)   # the kernel freed the dead worker's lock
    assert [key for key, _, _ in restarted.recovered()] == keys(1)
    with pytest.raises(TierDirectoryInUse):
        _open(directory)           # a second tier in the same process too
    restarted.close()
    _open(directory).close()       # close frees it


V1_HEX = "ab" * 16


def _make_entries(directory: Path, outside: Path) -> dict[str, bytes | Path]:
    """Files and symlinks the tier did not make, each named like what the old debris removal deleted:
    name -> content, or the symlink's target."""
    foreign: dict[str, bytes | Path] = {"notes.blk": b"mine", "x.blk": b"x", ".tmp-foo": b"foo",
                                        f"{'cd' * 16}.blk": b"not a block header",
                                        f"{'ef' * 16}.blk": outside, f".tmp-{V1_HEX}.blk": outside}
    for name, what in foreign.items():
        if isinstance(what, Path):
            (directory / name).symlink_to(what)
        else:
            (directory / name).write_bytes(what)
    return foreign


def _entries(directory: Path, names) -> dict[str, bytes | Path]:
    return {name: (directory / name).readlink() if (directory / name).is_symlink() else (directory / name).read_bytes()
            for name in names}


def test_opening_a_directory_removes_only_the_tiers_own_debris_and_leaves_every_other_file(tmp_path):
    outside = tmp_path / "precious"
    outside.write_bytes(b"precious")
    directory = tmp_path / "nvme"
    directory.mkdir()
    foreign = _make_entries(directory, outside)
    debris = {TMP_JOURNAL_NAME: b"half a rewrite", f"{V1_HEX}.blk": MAGIC + b"v1 block", f".tmp-{'01' * 16}.blk": b""}
    for name, content in debris.items():
        (directory / name).write_bytes(content)
    if os.geteuid() == 0:    # v1's name and magic, but another user's file
        (directory / f"{'02' * 16}.blk").write_bytes(MAGIC)
        os.chown(directory / f"{'02' * 16}.blk", NOBODY, NOBODY)
        foreign[f"{'02' * 16}.blk"] = MAGIC
    _open(directory).close()
    assert _entries(directory, foreign) == foreign
    assert outside.read_bytes() == b"precious"
    assert sorted(p.name for p in directory.iterdir()) == sorted([*foreign, *OWN_FILES])


@pytest.mark.parametrize("name", [SLAB_NAME, JOURNAL_NAME, TMP_JOURNAL_NAME, LOCK_NAME])
def test_a_symlink_under_one_of_the_tiers_names_is_refused_and_its_target_left_intact(tmp_path, name):
    outside = tmp_path / "precious"
    outside.write_bytes(b"precious")
    directory = tmp_path / "nvme"
    directory.mkdir()
    (directory / name).symlink_to(outside)
    outside_mode = _mode(outside)
    with pytest.raises(TierDirectoryError, match=f"{re.escape(str(directory / name))} is "):
        _open(directory)
    assert ((directory / name).readlink(), outside.read_bytes(), _mode(outside)) == (outside, b"precious", outside_mode)
    (directory / name).unlink()
    _open(directory).close()   # nothing held: the refused open let go of its lock
