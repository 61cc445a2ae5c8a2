"""A report row's stamp (bench/stamp.py) on a real git repository: the commit, and
whether and how the tree's code differs from it."""

from __future__ import annotations

import subprocess
from pathlib import Path

from bench.stamp import RunStamp, run_stamp


def _git(repo: Path, *args: str) -> str:
    return subprocess.run(["git", "-C", str(repo), *args], capture_output=True, text=True, check=True).stdout


def _repo(tmp_path: Path) -> Path:
    repo = tmp_path / "repo"
    (repo / "bench" / "report").mkdir(parents=True)
    (repo / "mesh.py").write_text("A = 1\n")
    (repo / "README.md").write_text("prose\n")
    (repo / "bench" / "report" / "faults.json").write_text("{}\n")
    _git(repo, "init", "-q")
    _git(repo, "add", ".")
    _git(repo, "-c", "user.name=t", "-c", "user.email=t@t", "commit", "-qm", "one")
    return repo


def test_a_clean_tree_is_stamped_with_its_commit(tmp_path):
    repo = _repo(tmp_path)
    stamp = run_stamp(repo)
    head = _git(repo, "rev-parse", "HEAD").strip()
    assert (stamp.commit, stamp.dirty, stamp.code) == (head, "", head[:7])
    assert stamp.machine and len(stamp.run_at) == len("2026-12-06 06:04")


def test_a_changed_or_added_source_file_makes_the_tree_dirty_and_each_change_its_own_hash(tmp_path):
    repo = _repo(tmp_path)
    (repo / "mesh.py").write_text("A = 2\n")
    edited = run_stamp(repo)
    (repo / "new_fault.py").write_text("B = 1\n")   # untracked code the campaign may import
    added = run_stamp(repo)
    (repo / "mesh.py").write_text("A = 3\n")
    assert len(edited.dirty) == 12 and len({edited.dirty, added.dirty, run_stamp(repo).dirty}) == 3
    assert edited.code == f"{edited.commit[:7]}+dirty.{edited.dirty}"
    (repo / "mesh.py").write_text("A = 2\n")
    (repo / "new_fault.py").unlink()
    assert run_stamp(repo).dirty == edited.dirty   # the same change, the same hash: parts can be added


def test_the_reports_a_run_writes_and_prose_leave_the_tree_clean(tmp_path):
    repo = _repo(tmp_path)
    (repo / "bench" / "report" / "faults.json").write_text('{"faults": []}\n')
    (repo / "README.md").write_text("more prose\n")
    (repo / "bench" / "report" / "faults.md").write_text("| a row |\n")
    assert run_stamp(repo).dirty == ""


def test_outside_a_git_checkout_the_commit_is_unknown(tmp_path):
    stamp = run_stamp(tmp_path)
    assert (stamp.commit, stamp.dirty, stamp.code) == ("", "", "unknown")
    assert RunStamp("", "", "", "").code == "unknown"
