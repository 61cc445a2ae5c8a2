"""The worker refuses a vLLM it was not built against, and says how to try one anyway."""

from __future__ import annotations

import pytest

from worker.vllm_ext.version import ALLOW_ENV, SUPPORTED_VLLM, check_vllm_version, installed_vllm


def test_the_installed_vllm_is_one_the_worker_was_built_against():
    assert installed_vllm() in SUPPORTED_VLLM
    check_vllm_version()


def test_another_vllm_is_refused_naming_both_versions(monkeypatch):
    monkeypatch.delenv(ALLOW_ENV, raising=False)
    with pytest.raises(RuntimeError, match=r"vLLM 0\.33\.0 is not .*\(0\.32\.0\).*PDMESH_ALLOW_VLLM=0\.33\.0"):
        check_vllm_version("0.33.0")


def test_an_operator_may_allow_one_more_version(monkeypatch):
    monkeypatch.setenv(ALLOW_ENV, "0.33.0")
    check_vllm_version("0.33.0")
    with pytest.raises(RuntimeError):
        check_vllm_version("0.34.0")
