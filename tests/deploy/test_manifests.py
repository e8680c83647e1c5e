"""The Kubernetes manifests in examples/k8s, offline: every document validates against the Kubernetes OpenAPI
JSON schemas shipped by `kubernetes-validate` (strict: unknown fields rejected), and the Lynx wiring is right
(the preset expands, side channel on the pod IP, readiness on /health, GPU requests, front-end URLs = pods:
`lynx proxy` in 1p1d.yaml, vllm-router in xpyd.yaml, whose arguments its own parser accepts)."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import pytest
import yaml

from lynx_connector.presets import expand_kv_transfer_config

kv = pytest.importorskip("kubernetes_validate", reason="kubernetes-validate (offline Kubernetes schemas) missing")

K8S = Path(__file__).resolve().parents[2] / "examples" / "k8s"
FILES = sorted(K8S.glob("*.yaml"))
VERSIONS = ["1.29.0", "1.37.0"]
#: The front end of each manifest: (Deployment name, command: None = the image's entrypoint, `lynx`).
FRONT_ENDS = {"1p1d.yaml": ("lynx-proxy", None), "xpyd.yaml": ("lynx-router", ["vllm-router"])}


def docs(path: Path) -> list[dict[str, Any]]:
    return [d for d in yaml.safe_load_all(path.read_text()) if d]


def by_kind(path: Path, kind: str) -> dict[str, dict[str, Any]]:
    return {d["metadata"]["name"]: d for d in docs(path) if d["kind"] == kind}


def test_manifests_exist() -> None:
    assert {p.name for p in FILES} >= {"1p1d.yaml", "xpyd.yaml", "networkpolicy.yaml"}


@pytest.mark.parametrize("version", VERSIONS)
@pytest.mark.parametrize("path", FILES, ids=lambda p: p.name)
def test_valid_against_kubernetes_schemas(path: Path, version: str) -> None:
    for doc in docs(path):
        try:
            kv.validate(doc, version, strict=True)
        except kv.ValidationError as exc:
            pytest.fail(f"{path.name}: {doc['kind']}/{doc['metadata']['name']} invalid for {version}: "
                        f"{exc.message} at {'/'.join(map(str, exc.path))}")


def _container(workload: dict[str, Any]) -> dict[str, Any]:
    (c,) = workload["spec"]["template"]["spec"]["containers"]
    return c


def _expand(arg: str, env: dict[str, str]) -> str:
    return re.sub(r"\$\((\w+)\)", lambda m: env[m.group(1)], arg)


@pytest.mark.parametrize("path", [K8S / "1p1d.yaml", K8S / "xpyd.yaml"], ids=lambda p: p.name)
def test_lynx_wiring(path: Path) -> None:
    cm = by_kind(path, "ConfigMap")["lynx-config"]["data"]
    sets = by_kind(path, "StatefulSet")
    services = by_kind(path, "Service")
    for role in ("prefill", "decode"):
        sts = sets[f"lynx-{role}"]
        assert services[sts["spec"]["serviceName"]]["spec"]["clusterIP"] == "None"  # per-pod DNS
        c = _container(sts)
        env = {**cm, "POD_IP": "10.1.2.3"}
        names = {e["name"] for e in c["env"]}
        assert {"POD_IP", "VLLM_HOST_IP"} <= names
        # the side-channel key: a Secret mounted read-only, named by LYNX_SIDE_CHANNEL_KEY_FILE (issue 14)
        key_file = next(e["value"] for e in c["env"] if e["name"] == "LYNX_SIDE_CHANNEL_KEY_FILE")
        mount = next(m for m in c["volumeMounts"] if m["name"] == "side-channel-key")
        assert key_file.startswith(mount["mountPath"] + "/") and mount["readOnly"] is True
        vol = next(v for v in sts["spec"]["template"]["spec"]["volumes"] if v["name"] == "side-channel-key")
        assert vol["secret"]["secretName"] == "lynx-side-channel-key" and key_file.endswith("/key")
        assert "LYNX_SIDE_CHANNEL_KEY" not in names and "insecure_side_channel" not in json.dumps(c["args"])
        # a key rotation's extra key: an optional key of the same Secret, unset outside a rotation
        extra_ref = next(e["valueFrom"]["secretKeyRef"] for e in c["env"] if e["name"] == "LYNX_SIDE_CHANNEL_EXTRA_KEY")
        assert extra_ref == {"name": "lynx-side-channel-key", "key": "extra", "optional": True}
        assert c["envFrom"][0]["configMapRef"]["name"] == "lynx-config"
        args = [_expand(a, env) for a in c["args"]]
        assert args[:2] == ["serve", cm["MODEL"]]
        # SIGTERM drains, then the workers close in order (P tells its Ds, D its Ps), within the pod's grace
        drain = [int(a.split("=", 1)[1]) for a in args if a.startswith("--shutdown-timeout=")]
        assert len(drain) == 1 and 0 < drain[0] < sts["spec"]["template"]["spec"]["terminationGracePeriodSeconds"]
        raw = args[args.index("--kv-transfer-config") + 1]
        expanded = json.loads(expand_kv_transfer_config(raw))
        # P only prefills: kv_producer, so a speculative preset installs no speculative scheduler there
        assert expanded["kv_connector"] == "LynxConnector"
        assert expanded["kv_role"] == ("kv_producer" if role == "prefill" else "kv_both")
        assert expanded["kv_load_failure_policy"] == "fail"
        extra = expanded["kv_connector_extra_config"]
        assert extra["side_channel_host"] == "10.1.2.3" and extra["mode"] == cm["LYNX_MODE"].split(":")[1]
        assert c["readinessProbe"]["httpGet"]["path"] == "/health"
        assert c["resources"]["limits"]["nvidia.com/gpu"] == "1"
        ports = {p["name"]: p["containerPort"] for p in c["ports"]}
        if role == "prefill":
            assert ports["side-channel"] == extra["side_channel_port"]
    name, command = FRONT_ENDS[path.name]
    front = _container(by_kind(path, "Deployment")[name])
    assert front.get("command") == command
    assert front["args"][0] == "proxy" if command is None else "--vllm-pd-disaggregation" in front["args"]
    assert front["readinessProbe"]["httpGet"]["path"] == "/health"
    assert services[name]["spec"]["selector"] == {"app.kubernetes.io/name": name}
    for role in ("prefill", "decode"):
        urls = [a.split("=", 1)[1] for a in front["args"] if a.startswith(f"--{role}=")]
        n = sets[f"lynx-{role}"]["spec"]["replicas"]
        assert urls == [f"http://lynx-{role}-{i}.lynx-{role}:8000" for i in range(n)]
    if command is None:  # lynx proxy: its default pipelined flow signs with the deployment key, mounted like P's
        key_file = next(e["value"] for e in front["env"] if e["name"] == "LYNX_SIDE_CHANNEL_KEY_FILE")
        mount = next(m for m in front["volumeMounts"] if m["name"] == "side-channel-key")
        assert key_file.startswith(mount["mountPath"] + "/") and mount["readOnly"] is True
        vols = by_kind(path, "Deployment")[name]["spec"]["template"]["spec"]["volumes"]
        assert next(v for v in vols if v["name"] == "side-channel-key")["secret"]["secretName"] == "lynx-side-channel-key"
        # it only signs, with the deployment key: a rotation's extra key is for P and D, which verify
        assert all(e["name"] != "LYNX_SIDE_CHANNEL_EXTRA_KEY" for e in front["env"])
    if path.name == "xpyd.yaml":
        assert sets["lynx-prefill"]["spec"]["replicas"] > 1 and sets["lynx-decode"]["spec"]["replicas"] > 1


def test_router_arguments_parse_with_vllm_router() -> None:
    """xpyd.yaml's router arguments, read by vllm-router's own parser and validation (the dev extra installs
    it): PD mode, every prefill and decode pod, no bootstrap port (Lynx's P names its side channel in
    kv_transfer_params)."""
    from vllm_router import launch_router as launch  # the dev extra installs vllm-router
    front = _container(by_kind(K8S / "xpyd.yaml", "Deployment")["lynx-router"])
    args = launch.parse_router_args(front["args"])
    args._validate_router_args()
    assert args.vllm_pd_disaggregation and (args.host, args.port) == ("0.0.0.0", 8000)
    sets = by_kind(K8S / "xpyd.yaml", "StatefulSet")
    assert args.prefill_urls == [(f"http://lynx-prefill-{i}.lynx-prefill:8000", None)
                                 for i in range(sets["lynx-prefill"]["spec"]["replicas"])]
    assert len(args.decode_urls) == sets["lynx-decode"]["spec"]["replicas"]
    ports = {p["name"]: p["containerPort"] for p in front["ports"]}
    assert ports == {"http": args.port, "metrics": args.prometheus_port}


def test_network_policy_admits_every_front_end() -> None:
    """networkpolicy.yaml lets each manifest's front end reach P's and D's HTTP port."""
    policies = by_kind(K8S / "networkpolicy.yaml", "NetworkPolicy")
    for policy in ("lynx-prefill", "lynx-decode"):
        http = [rule for rule in policies[policy]["spec"]["ingress"]
                if {"protocol": "TCP", "port": 8000} in rule["ports"]]
        (rule,) = http
        allowed = {sel["podSelector"]["matchLabels"]["app.kubernetes.io/name"] for sel in rule["from"]}
        assert allowed >= {name for name, _ in FRONT_ENDS.values()}, (policy, allowed)
