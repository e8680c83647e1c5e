"""lynx_connector.testing: per-request test hooks reach the worker only with LYNX_TEST_HOOKS=1, validated."""

from types import SimpleNamespace

from lynx_connector.config import LynxConfig
from lynx_connector.metadata import RemotePrefill
from lynx_connector.scheduler import LynxConnectorScheduler
from lynx_connector.signing import ParamsSigner
from lynx_connector.testing import TEST_HOOKS_ENV, TEST_HOOKS_PARAM, FaultHooks, fault_hooks
from lynx_connector.transport.keys import load_side_channel_key


class Blocks:
    def get_block_ids(self):
        return ([1, 2],)


def pull_hooks(hooks):
    s = LynxConnectorScheduler(SimpleNamespace(cache_config=SimpleNamespace(block_size=32)), "e",
                               LynxConfig.from_extra_config({}))
    params = RemotePrefill(transfer_id="a" * 32, token="b" * 32, engine_id="p", request_id="p-1", host="h",
                           ports=(5555,), num_tokens=64, mode="full").to_params()
    params = ParamsSigner(load_side_channel_key(), 60).sign(params)  # as P returns them (conftest's key)
    params[TEST_HOOKS_PARAM] = hooks  # the test's own key, unsigned (honoured only with LYNX_TEST_HOOKS=1)
    req = SimpleNamespace(request_id="d-1", num_prompt_tokens=64, kv_transfer_params=params,
                          use_structured_output=False, block_hashes=[])
    s.get_num_new_matched_tokens(req, 0)
    s.update_state_after_alloc(req, Blocks(), 64)
    return s.build_connector_meta(SimpleNamespace(num_scheduled_tokens={})).test_hooks


def test_hooks_ignored_without_the_environment_switch(monkeypatch):
    monkeypatch.delenv(TEST_HOOKS_ENV, raising=False)
    assert pull_hooks({"fail_residual": True}) == {}


def test_hooks_validated_and_sent_with_the_switch(monkeypatch):
    monkeypatch.setenv(TEST_HOOKS_ENV, "1")
    hooks = {"fail_residual": True, "corrupt_residual": "yes", "delay_residual_steps": 10**9, "other": 1}
    assert pull_hooks(hooks) == {"d-1": {"fail_residual": True, "delay_residual_steps": 100_000}}
    assert pull_hooks("not a dict") == {}


def test_worker_side_answers():
    none = fault_hooks(LynxConfig())
    assert none.residual_error("r") is None and not none.defer_merge("r", 0, 0) and none.due_merges(5) == []
    f = FaultHooks()
    f.track("r", {"delay_residual_steps": 3, "fail_residual": True})
    assert f.residual_error("r") and f.defer_merge("r", 1, 2)
    assert f.due_merges(3) == [] and f.due_merges(4) == ["r"] and f.due_merges(5) == []
    f.forget("r")
    assert f.residual_error("r") is None and not f.defer_merge("r", 1, 2)
    assert fault_hooks(LynxConfig(fault_injection="corrupt_residual")).corrupt_all


def test_flip_bit_hook_is_validated_and_answered_for_its_plane(monkeypatch):
    monkeypatch.setenv(TEST_HOOKS_ENV, "1")
    flip = {"plane": "anchor", "layer": 1, "byte": 40, "bit": 9}
    assert pull_hooks({"flip_bit": flip}) == {"d-1": {"flip_bit": {"plane": "anchor", "layer": 1, "byte": 40,
                                                                   "bit": 1}}}
    assert pull_hooks({"flip_bit": {"plane": "kv", "layer": 0, "byte": 0, "bit": 0}}) == {}
    assert pull_hooks({"flip_bit": {"plane": "anchor", "layer": -1, "byte": 0, "bit": 0}}) == {}
    f = FaultHooks()
    f.track("r", {"flip_bit": {"plane": "residual", "layer": 2, "byte": 5, "bit": 3}})
    assert f.flip_bit("r", "anchor") is None and f.flip_bit("r", "residual") == (2, 5, 3)
    assert fault_hooks(LynxConfig()).flip_bit("r", "residual") is None
