"""Signed kv_transfer_params (issue 14.6): what P signs, what D accepts. The real thing (a forged request sent
straight to a real decode engine) is in tests/integration/test_signed_params.py."""

from __future__ import annotations

import json
import secrets

import pytest

from lynx_connector.fanout import CHILDREN_KEY, MAX_CHILDREN
from lynx_connector.metadata import RemotePrefill
from lynx_connector.signing import (
    EXPIRES_KEY,
    PROMPT_KEY,
    SIG_KEY,
    SIGNED_KEYS,
    ParamsRefused,
    ParamsSigner,
    RefusalLog,
    check_prompt,
    prompt_digest,
)

KEY = secrets.token_bytes(32)


class Clock:
    def __init__(self, t: float = 1_800_000_000.0):
        self.t = t

    def __call__(self) -> float:
        return self.t


def p_params(**over):
    p = RemotePrefill(engine_id="engine-p", request_id="p-1", host="10.1.2.3", ports=(5600, 5601), num_tokens=100,
                      mode="full", transfer_id="a" * 32, token="b" * 32, first_token=42,
                      kv_dtype="bfloat16").to_params()
    # n > 1: P's answer lists every child's transfer (lynx_connector/fanout.py)
    p["lynx_children"] = [{"child": 0, "remote_request_id": "0_p", "lynx_transfer_id": "e" * 32,
                           "lynx_token": "f" * 32, "lynx_first_token": 7}]
    p[PROMPT_KEY] = prompt_digest(list(range(100)))
    p.update(over)
    return p


def refused(signer, params) -> str:
    with pytest.raises(ParamsRefused) as exc:
        signer.verify(params)
    return exc.value.reason


def test_signed_params_verify_and_survive_a_json_relay():
    clock = Clock()
    signer = ParamsSigner(KEY, 120, clock)
    signed = signer.sign(p_params())
    assert signed[EXPIRES_KEY] == 1_800_000_120 and len(signed[SIG_KEY]) == 64
    signer.verify(signed)
    # a router that parses and re-serializes the JSON (other key order, whitespace) keeps them valid
    relayed = json.loads(json.dumps(dict(reversed(list(signed.items()))), indent=2))
    signer.verify(relayed)
    # keys D does not read may be added on the way (vLLM adds remote_prefill_cached_tokens on P)
    signer.verify({**signed, "remote_prefill_cached_tokens": 32, "something_else": [1, 2]})
    # every key D reads is signed: RemotePrefill.to_params' keys, the prompt digest, the expiry
    assert set(p_params()) | {EXPIRES_KEY} <= set(SIGNED_KEYS)


@pytest.mark.parametrize("key, value", [
    ("remote_host", "127.0.0.1"), ("remote_port", 1), ("lynx_ports", [1]), ("lynx_ports", [5600]),
    ("remote_engine_id", "x"), ("remote_request_id", "p-2"), ("remote_num_tokens", 99),
    ("lynx_mode", "int4"), ("lynx_version", 1), ("lynx_transfer_id", "c" * 32),
    ("lynx_token", "d" * 32), ("lynx_first_token", 43), ("do_remote_prefill", 1), (PROMPT_KEY, "0" * 64),
    (EXPIRES_KEY, 1_900_000_000), ("lynx_kv_dtype", "float32"),
    ("lynx_children", [{"child": 0, "remote_request_id": "0_p", "lynx_transfer_id": "c" * 32,
                        "lynx_token": "f" * 32, "lynx_first_token": 7}]),
])
def test_a_tampered_field_fails_the_signature(key, value):
    signer = ParamsSigner(KEY, 120, Clock())
    signed = signer.sign(p_params())
    assert refused(signer, {**signed, key: value}) == "bad_signature"


@pytest.mark.parametrize("key", ["lynx_first_token", PROMPT_KEY, "lynx_ports", EXPIRES_KEY])
def test_a_removed_or_added_signed_field_fails_the_signature(key):
    signer = ParamsSigner(KEY, 120, Clock())
    signed = signer.sign(p_params())
    stripped = {k: v for k, v in signed.items() if k != key}
    assert refused(signer, stripped) == "bad_signature"
    bare = signer.sign({k: v for k, v in p_params().items() if k != "lynx_first_token"})
    assert refused(signer, {**bare, "lynx_first_token": 7}) == "bad_signature"


def test_wrong_key_missing_or_garbled_signature_and_insecure_mode():
    clock = Clock()
    signer = ParamsSigner(KEY, 120, clock)
    other = ParamsSigner(secrets.token_bytes(32), 120, clock).sign(p_params())
    assert refused(signer, other) == "bad_signature"
    assert refused(signer, p_params()) == "unsigned"
    for sig in ("", "zz", 12, "0" * 64, ["a"]):
        assert refused(signer, {**signer.sign(p_params()), SIG_KEY: sig}) == "bad_signature"
    # insecure deployments sign with the empty key (as the transport does): valid between insecure peers only
    insecure = ParamsSigner(None, 120, clock)
    insecure.verify(insecure.sign(p_params()))
    assert refused(signer, insecure.sign(p_params())) == "bad_signature"
    assert refused(insecure, signer.sign(p_params())) == "bad_signature"


def test_key_rotation_accepts_the_extra_key_and_signs_with_its_own():
    """During a key rotation an instance verifies params signed with its deployment key or its extra key (its
    peers may already sign with the new one, or still with the old), and signs with its deployment key only."""
    clock = Clock()
    new = secrets.token_bytes(32)
    rotating = ParamsSigner(new, 120, clock, extra_keys=(KEY,))
    rotating.verify(ParamsSigner(KEY, 120, clock).sign(p_params()))
    rotating.verify(ParamsSigner(new, 120, clock).sign(p_params()))
    assert refused(rotating, ParamsSigner(secrets.token_bytes(32), 120, clock).sign(p_params())) == "bad_signature"
    signed = rotating.sign(p_params())
    ParamsSigner(new, 120, clock).verify(signed)
    assert refused(ParamsSigner(KEY, 120, clock), signed) == "bad_signature"  # not signed with the extra key
    tampered = {**ParamsSigner(KEY, 120, clock).sign(p_params()), "remote_host": "10.9.9.9"}
    assert refused(rotating, tampered) == "bad_signature"


def test_expiry():
    clock = Clock()
    signer = ParamsSigner(KEY, 30, clock)
    signed = signer.sign(p_params())
    clock.t += 30
    signer.verify(signed)  # valid up to and including the expiry second
    clock.t += 1.5
    assert refused(signer, signed) == "expired"
    # re-signing after the fact needs the key: a client cannot extend the validity
    assert refused(signer, {**signed, EXPIRES_KEY: signed[EXPIRES_KEY] + 60}) == "bad_signature"
    with pytest.raises(ValueError):
        ParamsSigner(KEY, 0)


@pytest.mark.parametrize("value", [1.5, {"a": 1}, "x" * 5000, list(range(2000)), [1.0], 2**60, float("nan")])
def test_values_that_are_not_plain_json_are_malformed_before_any_mac(value):
    signer = ParamsSigner(KEY, 120, Clock())
    assert refused(signer, {**signer.sign(p_params()), "remote_host": value}) == "malformed"


_CHILD = {"child": 0, "remote_request_id": "0_p", "lynx_transfer_id": "e" * 32, "lynx_token": "f" * 32,
          "lynx_first_token": 7}


@pytest.mark.parametrize("value", [
    [dict(_CHILD, child=i) for i in range(MAX_CHILDREN + 1)],  # too many children
    [dict(_CHILD, lynx_first_token={"a": 1})],  # a nested dict
    [dict(_CHILD, lynx_first_token=[1, 2])],  # a nested list (even of integers)
    [dict(_CHILD, **{f"k{i}": i for i in range(4)})],  # a child with too many keys (9)
    dict(_CHILD),  # not a list
    [dict(_CHILD, lynx_token="x" * 5000)],  # an oversized scalar
])
def test_children_that_are_not_a_bounded_list_of_flat_dicts_are_malformed(value):
    """``lynx_children`` has its own shape check (a bounded list of flat dicts of plain scalars): anything else is
    refused as malformed before any MAC, like any other signed value that is not plain JSON."""
    signer = ParamsSigner(KEY, 120, Clock())
    assert refused(signer, {**signer.sign(p_params()), CHILDREN_KEY: value}) == "malformed"


@pytest.mark.parametrize("expires", ["x", True, None])
def test_an_expiry_that_is_not_an_integer_is_malformed_even_when_it_verifies(expires):
    """Insecure deployments sign with the empty key, so anyone can MAC params carrying a non-integer (or no)
    ``lynx_expires``: D refuses them as malformed, not with a TypeError (a string) or as expired (a bool)."""
    insecure = ParamsSigner(None, 120, Clock())
    params = {**p_params(), EXPIRES_KEY: expires}
    if expires is None:
        del params[EXPIRES_KEY]
    forged = {**params, SIG_KEY: insecure._mac(params)}
    assert refused(insecure, forged) == "malformed"

def test_prompt_binding():
    ids = list(range(100))
    params = p_params()
    check_prompt(params, ids, 100)
    check_prompt(params, ids + [7, 8], 100)  # D's prompt may go on (P's counts the first num_tokens)
    for other in (ids[:99], ids[:99] + [5], None):
        with pytest.raises(ParamsRefused) as exc:
            check_prompt(params, other, 100)
        assert exc.value.reason == "prompt_mismatch"
    check_prompt({k: v for k, v in params.items() if k != PROMPT_KEY}, None, 100)  # P had no token ids
    assert prompt_digest([1, 2]) != prompt_digest([2, 1]) and prompt_digest([2**40]) != prompt_digest([0])


def test_refusal_log_is_rate_limited_per_reason(caplog):
    clock = Clock(0.0)
    log = RefusalLog(every_s=10, clock=clock)
    unsigned, expired = ParamsRefused("unsigned", "no sig"), ParamsRefused("expired", "late")
    assert log.warn("r1", unsigned) and not log.warn("r2", unsigned) and not log.warn("r3", unsigned)
    assert log.warn("r4", expired)  # another reason is not held back
    clock.t = 10.5
    with caplog.at_level("WARNING"):
        assert log.warn("r5" * 500, unsigned)
    assert "2 more refused" in caplog.text and "r5" * 64 in caplog.text and "r5" * 65 not in caplog.text
