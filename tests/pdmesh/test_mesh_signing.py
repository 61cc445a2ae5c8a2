"""The signature on Redis entries: pinned to a value computed apart (openssl), bound to the key, the
purpose and every field, and False, never an exception, for whatever an attacker stores."""

from __future__ import annotations

import pytest

from pdmesh.mesh_signing import KV_INDEX_PURPOSE, REGISTRY_PURPOSE, EntrySigner, signer_for

KEY = "pdmesh:workers:decode:a:1"
FIELDS = {"role": "decode", "address": "a:1"}


def test_the_signature_is_hmac_sha256_of_the_canonical_key_and_fields_under_a_derived_key():
    # k = HMAC-SHA256("t", "pdmesh-registry-v1");
    # HMAC-SHA256(k, '["pdmesh:workers:decode:a:1",{"address":"a:1","role":"decode"}]'), by openssl dgst
    assert EntrySigner("t", REGISTRY_PURPOSE).sign(KEY, FIELDS) == \
        "8c7982413f35773dd69ef91a27e8ea96d7ccca7220503b20fdd59f0d14e1214d"


def test_a_signature_holds_only_for_its_token_purpose_key_and_fields():
    signature = EntrySigner("t", REGISTRY_PURPOSE).sign(KEY, FIELDS)
    assert EntrySigner("t", REGISTRY_PURPOSE).verify(KEY, dict(reversed(FIELDS.items())), signature)
    assert not EntrySigner("u", REGISTRY_PURPOSE).verify(KEY, FIELDS, signature)
    assert not EntrySigner("t", KV_INDEX_PURPOSE).verify(KEY, FIELDS, signature)
    assert not EntrySigner("t", REGISTRY_PURPOSE).verify(KEY + "0", FIELDS, signature)
    assert not EntrySigner("t", REGISTRY_PURPOSE).verify(KEY, FIELDS | {"address": "a:2"}, signature)
    assert not EntrySigner("t", REGISTRY_PURPOSE).verify(KEY, FIELDS | {"zone": "b"}, signature)


@pytest.mark.parametrize("signature", [None, "", "zz", "0" * 64, "\u00e9" * 64, "\ud800", "\ufffd" * 64])
def test_a_missing_or_made_up_signature_is_false(signature):
    assert not EntrySigner("t", REGISTRY_PURPOSE).verify(KEY, FIELDS, signature)


def test_fields_without_a_canonical_form_are_false_not_an_error():
    signer = EntrySigner("t", REGISTRY_PURPOSE)
    assert not signer.verify(KEY, FIELDS | {"kv_cache_usage": float("nan")}, "0" * 64)
    assert not signer.verify(KEY, FIELDS | {"x": object()}, "0" * 64)


def test_no_token_no_signer():
    assert signer_for(None, REGISTRY_PURPOSE) is None and signer_for("", REGISTRY_PURPOSE) is None
    with pytest.raises(ValueError):
        EntrySigner("", REGISTRY_PURPOSE)
