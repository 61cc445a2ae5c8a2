"""The tenants' cache salts (gateway/cache_salt.py): keyed, unambiguous, empty for the anonymous cache."""

from __future__ import annotations

import logging

from gateway.cache_salt import CacheSalts, salt_key


def test_the_salt_is_keyed_and_names_tenant_and_request_salt_unambiguously():
    salts = CacheSalts(b"k")
    assert salts.salt_of("a") == CacheSalts(b"k").salt_of("a") != CacheSalts(b"k2").salt_of("a")
    assert salts.salt_of("a", "b\0c") != salts.salt_of("a\0b", "c")   # the unkeyed scheme joined them with \0
    assert salts.salt_of("", "") == "" and len(salts.salt_of("", "mine")) == 32   # anonymous: one shared cache


def test_the_key_is_the_salt_secret_else_derived_from_the_mesh_token_else_random(caplog):
    assert salt_key("s", "token") == b"s"
    derived = salt_key(None, "token")
    assert derived == salt_key("", "token") != b"token" and len(derived) == 32
    with caplog.at_level(logging.WARNING, logger="gateway.cache_salt"):
        first, second = salt_key(None, None), salt_key(None, None)
    assert first != second and len(first) == 32
    assert "cached prefixes are not found across gateways or after a restart" in caplog.text
