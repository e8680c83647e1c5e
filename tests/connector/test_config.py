import pytest

from lynx_connector.config import LynxConfig, LynxConfigError


def test_defaults_are_valid():
    cfg = LynxConfig.from_extra_config(None)
    assert cfg.mode == "full" and cfg.two_stream and cfg.codec_name == "lynx"
    assert cfg.link_gbps is None


def test_strings_are_parsed_as_numbers():
    cfg = LynxConfig.from_extra_config(
                                       {"mode": "INT8", "link_gbps": "10", "chunk_bytes": "65536",
                                        "window_bytes": "0x100000", "timeout_s": "2.5"})
    assert cfg.mode == "int8" and not cfg.two_stream and cfg.codec_name == "int8"
    assert cfg.link_gbps == 10.0 and cfg.chunk_bytes == 65536 and cfg.window_bytes == 1 << 20
    assert cfg.timeout_s == 2.5


@pytest.mark.parametrize("extra, key", [
    ({"mode": "lossy"}, "mode"),
    ({"link_gbps": 0}, "link_gbps"),
    ({"link_gbps": "fast"}, "link_gbps"),
    ({"link_gbps": float("nan")}, "link_gbps"),
    ({"chunk_bytes": 12.5}, "chunk_bytes"),
    ({"chunk_bytes": True}, "chunk_bytes"),
    ({"side_channel_port": 70000}, "side_channel_port"),
    ({"timeout_s": 0}, "timeout_s"),
    ({"chunk_bytes": 1 << 20, "window_bytes": 1 << 16}, "window_bytes"),
    ({"fault_injection": "drop_everything"}, "fault_injection"),
    ({"side_channel_host": "  "}, "side_channel_host"),
    ({"side_channel_host": None}, "side_channel_host"),  # was the host name "None"
    ({"side_channel_host": "null"}, "side_channel_host"),
    # what P binds is also what it tells D: a wildcard, a URL or host:port failed late
    ({"side_channel_host": "0.0.0.0"}, "side_channel_host.*wildcard"),
    ({"side_channel_host": "::"}, "side_channel_host"),
    ({"side_channel_host": "10.0.0.5:5600"}, "side_channel_host.*no port"),
    ({"side_channel_host": "tcp://10.0.0.5"}, "side_channel_host"),
    ({"side_channel_host": "[::]"}, "side_channel_host.*wildcard"),
    ({"side_channel_host": "[fd00::zz]"}, "side_channel_host.*IPv6"),
    ({"codec_options": [1, 2]}, "codec_options"),
    ({"speculative_min_margin": -0.1}, "speculative_min_margin"),
    ({"speculative_min_margin": "inf"}, "speculative_min_margin"),
    ({"allowed_modes": "full,int3"}, "allowed_modes"),
    ({"allowed_modes": []}, "allowed_modes"),  # an empty list names no mode; null = the default
    ({"allowed_modes": 3}, "allowed_modes"),
    ({"allowed_modes": ["int4"]}, "allowed_modes"),  # must include the instance's own mode (full)
    ({"params_ttl_s": 0.5}, "params_ttl_s"),
    ({"idle_wait_s": -0.01}, "idle_wait_s"),
    ({"idle_wait_s": 5}, "idle_wait_s"),
    ({"idle_wait_s": "soon"}, "idle_wait_s"),
    # numbers too large for an int or a float: a LynxConfigError naming the key, not a bare OverflowError
    ({"staging_mb": float("inf")}, "staging_mb"),
    ({"chunk_bytes": "-Infinity"}, "chunk_bytes"),
    ({"timeout_s": 10**400}, "timeout_s"),
    ({"link_gbps": 10**400}, "link_gbps"),
    # durations past limits.MAX_SECONDS: the wire refuses such a lease, threading waits such a timeout
    ({"lease_s": 2e6}, "lease_s"),
    ({"timeout_s": "1e10"}, "timeout_s"),
    ({"params_ttl_s": "inf"}, "params_ttl_s"),
    ({"concurrent_wait_s": 1e7}, "concurrent_wait_s"),
    ({"link_gbps": 1e-6}, "link_gbps"),  # the default lease (1.25x the pool's drain time) would be 2.7e6 s
    # codec_options are the Lynx codec's, checked whatever the instance's own mode (a request may ask for full)
    ({"mode": "bf16", "codec_options": {"k_grop": "channel"}}, "codec_options"),
    ({"mode": "bf16", "codec_options": {"k_group": "per-channel"}}, "codec_options"),
    ({"codec_options": {"k_group_tokens": 0}}, "codec_options"),
    ({"codec_options": {"v_group_tokens": "many"}}, "codec_options"),
    ({"codec_options": {"group_tokens": 2.5}}, "codec_options"),
])
def test_bad_values_name_the_key(extra, key):
    with pytest.raises(LynxConfigError, match=key):
        LynxConfig.from_extra_config(extra)


def test_unknown_keys_are_warned(caplog):
    import logging

    with caplog.at_level(logging.WARNING):
        LynxConfig.from_extra_config({"modee": "full"})
    assert any("modee" in r.getMessage() for r in caplog.records)


def test_null_link_rate_means_unpaced():
    assert LynxConfig.from_extra_config({"link_gbps": "null"}).link_gbps is None


def test_speculative_min_margin_parses_and_zero_disables():
    assert LynxConfig.from_extra_config(None).speculative_min_margin == 0.4
    assert LynxConfig.from_extra_config({"speculative_min_margin": "0"}).speculative_min_margin == 0.0
    assert LynxConfig.from_extra_config({"speculative_min_margin": 1.25}).speculative_min_margin == 1.25


def test_default_lease_covers_draining_a_full_pool_and_a_short_one_is_refused():
    """256 MiB of staging at 7 Mb/s takes 307 s: the default lease grows to 1.25x that; an explicit 120 s lease
    is a start-up error naming the minimum (P could otherwise free staging D is still reading)."""
    assert LynxConfig.from_extra_config({}).transport_config(0, None, "p").lease_s == 120.0
    assert LynxConfig.from_extra_config({"link_gbps": 1}).transport_config(0, None, "p").lease_s == 120.0
    slow = LynxConfig.from_extra_config({"link_gbps": 0.007, "lease_s": "null"})
    assert slow.transport_config(0, None, "p").lease_s == 384.0
    # refused where the config is read (it was refused only in the worker, after the model and KV cache loaded)
    with pytest.raises(LynxConfigError, match=r"lease_s \(120 s\).*at least 307 or lower staging_mb"):
        LynxConfig.from_extra_config({"link_gbps": 0.007, "lease_s": 120})
    small = LynxConfig.from_extra_config({"link_gbps": 0.007, "lease_s": 120, "staging_mb": 64})
    assert small.transport_config(0, None, "p").lease_s == 120.0


@pytest.mark.parametrize("key", ["report_speculation", "insecure_side_channel"])
def test_boolean_keys_parse_strings_and_refuse_others(key):
    assert getattr(LynxConfig(), key) is False
    assert getattr(LynxConfig.from_extra_config({key: "true"}), key) is True
    assert getattr(LynxConfig.from_extra_config({key: False}), key) is False
    with pytest.raises(LynxConfigError, match=key):
        LynxConfig.from_extra_config({key: "maybe"})
    with pytest.raises(LynxConfigError, match=key):
        LynxConfig.from_extra_config({key: 1})


def test_allowed_modes():
    from lynx_connector.modes import MODE_NAMES

    assert LynxConfig.from_extra_config({}).allowed_modes == ("full", "speculative", "bf16", "auto")
    # the instance's own mode is allowed by default too (the operator chose it)
    assert LynxConfig.from_extra_config({"mode": "int4"}).allowed_modes == ("full", "speculative", "bf16", "auto",
                                                                            "int4")
    assert LynxConfig.from_extra_config({"allowed_modes": " FULL, int8 ,full"}).allowed_modes == ("full", "int8")
    assert LynxConfig.from_extra_config({"allowed_modes": ["full", "anchor"]}).mode_allowed("anchor")
    assert LynxConfig.from_extra_config({"allowed_modes": "all"}).allowed_modes == (*MODE_NAMES, "auto")
    assert not LynxConfig.from_extra_config({}).mode_allowed("int4")


def test_auto_mode_config():
    cfg = LynxConfig.from_extra_config({"mode": "AUTO"})
    assert cfg.mode == "auto" and cfg.auto_modes == ("full", "speculative", "bf16") == cfg.concrete_modes
    assert cfg.two_stream and cfg.codec_name == "lynx"
    # auto picks only among the allowed full-precision modes; with none of them allowed it is refused
    assert LynxConfig.from_extra_config({"mode": "auto", "allowed_modes": "bf16,auto,int4"}).auto_modes == ("bf16",)
    with pytest.raises(LynxConfigError, match="auto needs"):
        LynxConfig.from_extra_config({"mode": "int4", "allowed_modes": "int4,auto"})
    with pytest.raises(LynxConfigError, match="transfer_order"):
        LynxConfig.from_extra_config({"transfer_order": "lifo"})
    t = LynxConfig.from_extra_config({"transfer_order": "arrival", "max_stream_wait_s": "2"}).transport_config(
        0, None, "x")
    assert (t.order, t.max_wait_s) == ("arrival", 2.0)


def test_params_ttl_defaults_to_the_lease():
    assert LynxConfig.from_extra_config({"lease_s": 45}).signed_params_ttl_s == 45
    assert LynxConfig.from_extra_config({}).signed_params_ttl_s == 120  # the default lease
    # a lease lengthened for a slow link (a full pool's drain time) lengthens the validity with it
    assert LynxConfig.from_extra_config({"link_gbps": 0.007}).signed_params_ttl_s == 384
    assert LynxConfig.from_extra_config({"lease_s": 45, "params_ttl_s": "300"}).signed_params_ttl_s == 300


def test_codec_options_parse_group_sizes_from_strings():
    cfg = LynxConfig.from_extra_config({"codec_options": {"k_group_tokens": "32", "v_group": "channel"}})
    assert cfg.codec_options == {"k_group_tokens": 32, "v_group": "channel"}


def test_largest_durations_are_accepted_and_reach_the_transport():
    from lynx_connector.limits import MAX_SECONDS

    cfg = LynxConfig.from_extra_config({"lease_s": MAX_SECONDS, "timeout_s": MAX_SECONDS})
    tc = cfg.transport_config(0, None, "p")
    assert tc.lease_s == MAX_SECONDS and tc.timeout_s == MAX_SECONDS
    with pytest.raises(LynxConfigError, match="lease_s"):  # built directly, not from the extra config
        LynxConfig(lease_s=MAX_SECONDS * 2)


def test_settings_that_fail_only_at_worker_start_name_the_setting(tmp_path):
    """A fixed side-channel port is offset by the tensor-parallel rank; a status_dir must be a folder."""
    cfg = LynxConfig.from_extra_config({"side_channel_port": 65535})
    assert cfg.transport_config(0, None, "p").port == 65535
    with pytest.raises(LynxConfigError, match="side_channel_port.*rank 1"):
        cfg.transport_config(1, None, "p")
    afile = tmp_path / "not_a_folder"
    afile.write_text("")
    with pytest.raises(LynxConfigError, match="status_dir"):
        LynxConfig.from_extra_config({"status_dir": str(afile)}).transport_config(0, None, "p")


def test_a_side_channel_host_d_can_reach_is_accepted():
    for host in ("10.1.2.3", "prefill-0.prefill.default.svc.cluster.local", "p_1", "localhost"):
        assert LynxConfig.from_extra_config({"side_channel_host": f" {host} "}).side_channel_host == host


@pytest.mark.parametrize("null", [None, "", " ", "none", "None", "NULL"])
def test_every_key_that_can_be_unset_reads_null_alike(null):
    """One spelling of "not set" for every such key: ``status_dir: "null"`` made a folder named null,
    ``auto_speculative: "None"`` and ``fault_injection: "null"`` were refused, ``codec_options: null`` too."""
    keys = ("status_dir", "auto_speculative", "fault_injection", "codec_options", "allowed_modes", "lease_s",
            "params_ttl_s", "link_gbps")
    cfg = LynxConfig.from_extra_config({k: null for k in keys})
    assert cfg == LynxConfig.from_extra_config({})



def test_a_lease_shorter_than_timeout_s_is_refused_and_the_default_lease_covers_it():
    """D may wait up to timeout_s for its own staging before it pulls, without renewing P's lease: a shorter lease
    would free P's staging under a request D is about to pull (review)."""
    with pytest.raises(LynxConfigError, match="lease_s=10 is shorter than timeout_s=30"):
        LynxConfig.from_extra_config({"lease_s": 10})
    assert LynxConfig.from_extra_config({"lease_s": 30}).effective_lease_s == 30
    assert LynxConfig.from_extra_config({}).effective_lease_s == 120
    assert LynxConfig.from_extra_config({"timeout_s": 300}).effective_lease_s == 300
