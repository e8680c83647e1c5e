"""scripts/check_vllm_api.py on small synthetic vLLM trees and a synthetic plugin (no network, no vLLM import):
each kind of use it reads from the plugin and each kind of difference it must report. The real comparison
(installed vLLM vs the 0.33.0 wheel) is its committed report, benchmarks/results/vllm_api_0.33.0.{json,md}."""

from __future__ import annotations

import importlib.util
import json
import sys
import textwrap
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def api():
    spec = importlib.util.spec_from_file_location("check_vllm_api", ROOT / "scripts" / "check_vllm_api.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules["check_vllm_api"] = module  # dataclasses look their module up
    spec.loader.exec_module(module)
    yield module
    sys.modules.pop("check_vllm_api", None)


def write(root: Path, files: dict[str, str]) -> Path:
    for rel, text in files.items():
        path = root / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(textwrap.dedent(text))
    return root


OLD = {
    "vllm/__init__.py": '''
        MODULE_ATTRS = {"LLM": ".entry:LLM"}
        def __getattr__(name):
            raise AttributeError(name)
    ''',
    "vllm/entry.py": '''
        class LLM:
            def __init__(self, model, seed=0):
                self.model = model
    ''',
    "vllm/base.py": '''
        from abc import ABC, abstractmethod
        class Manager:
            def free(self, req):
                return None
        class Base(ABC):
            def __init__(self, cfg):
                self.running = []
                self.manager = Manager()
            @abstractmethod
            def start(self, x):
                raise NotImplementedError
            def step(self, out, extra=None):
                return 1
        class CacheConfig:
            block_size: int = 16
        class Config:
            cache: "CacheConfig | None" = None
    ''',
    "vllm/reexport.py": "from vllm.base import Base as Base\n",
    "vllm/engine/arg_utils.py": '''
        class EngineArgs:
            kept_flag: int = 0
            gone_flag: int = 0
    ''',
}

PLUGIN = {
    "lynx_connector/__init__.py": "",
    "lynx_connector/mine.py": '''
        from vllm import LLM
        from vllm.base import Config
        from vllm.reexport import Base

        class Mine(Base):
            def start(self, x):
                return super().step(x)

            def go(self):
                self.manager.free(1)
                self.running = [r for r in self.running if r]
                self._own = 1
                return self._own

        def block(cfg: Config) -> int:
            return cfg.cache.block_size

        def make():
            return LLM("m", seed=1)
    ''',
    "lynx_connector/lab/launch.py": '''
        def serve_args():
            return ["serve", "--kept-flag", "--gone-flag"]
    ''',
}


def _items(report: dict) -> dict[tuple[str, str], dict]:
    return {(i["kind"], i["symbol"]): i for i in report["items"]}


def test_identical_trees_differ_nowhere(api, tmp_path: Path) -> None:
    old = write(tmp_path / "old", OLD)
    plugin = write(tmp_path / "plugin", PLUGIN)
    report = api.build_report(old, "old", old, "same", "cmd", root=plugin)
    statuses = {i["status"] for i in report["items"]}
    assert statuses <= {"ok", "plugin-only"}, [i for i in report["items"] if i["status"] not in ("ok", "plugin-only")]
    assert report["summary"]["breaking"] == 0 and not report["summary"]["bodies_changed"]
    assert report["verdict"].startswith("nothing the plugin uses differs")
    items = _items(report)
    # what was read from the plugin: imports (a lazy table and a re-export), base-class state and methods, an
    # annotated parameter's chain, a call with keywords, the flags it passes
    for key in [("import", "vllm:LLM"), ("import", "vllm.reexport:Base"), ("inherited", "vllm.reexport:Base.running"),
                ("inherited", "vllm.reexport:Base.manager.free"), ("inherited", "vllm.reexport:Base.step"),
                ("override", "vllm.reexport:Base.start"), ("attribute", "vllm.base:Config.cache.block_size"),
                ("call", "vllm:LLM"), ("flag", "--kept-flag"), ("flag", "--gone-flag")]:
        assert items[key]["status"] == "ok", (key, items.get(key))
    assert items[("inherited", "vllm.reexport:Base._own")]["status"] == "plugin-only"


def test_every_kind_of_difference_is_reported(api, tmp_path: Path) -> None:
    new_files = dict(OLD)
    new_files["vllm/entry.py"] = '''
        class LLM:
            def __init__(self, model, *, tokenizer=None):
                self.model = model
    '''
    new_files["vllm/base.py"] = '''
        from abc import ABC, abstractmethod
        class Manager:
            def release(self, req):
                return None
        class Base(ABC):
            def __init__(self, cfg):
                self.running = []
                self.manager = Manager()
            @abstractmethod
            def start(self, x):
                return x
            @abstractmethod
            def stop(self):
                raise NotImplementedError
            def step(self, out, *, extra=None):
                return 1
        class CacheConfig:
            page_size: int = 16
        class Config:
            cache: "CacheConfig | None" = None
    '''
    new_files["vllm/engine/arg_utils.py"] = '''
        class EngineArgs:
            kept_flag: int = 0
    '''
    old, new = write(tmp_path / "old", OLD), write(tmp_path / "new", new_files)
    plugin = write(tmp_path / "plugin", PLUGIN)
    report = api.build_report(old, "old", new, "new", "cmd", root=plugin)
    items = _items(report)

    def why(kind: str, symbol: str) -> str:
        item = items[(kind, symbol)]
        assert item["status"] == "breaks", item
        return item["why"]

    assert "Base.manager.free is gone" in why("inherited", "vllm.reexport:Base.manager.free")
    assert "Base.manager.free is gone" in why("call", "vllm.reexport:Base.manager.free")  # called, too
    assert why("inherited", "vllm.reexport:Base.step") == "(self, out, extra=) -> (self, out, *, extra=)"
    assert "stop" in why("abstract", "vllm.reexport:Base")
    assert "block_size is gone" in why("attribute", "vllm.base:Config.cache.block_size")
    assert "no parameter seed" in why("call", "vllm:LLM")
    assert why("flag", "--gone-flag") == "the flag is gone"
    assert items[("flag", "--kept-flag")]["status"] == "ok"
    assert items[("override", "vllm.reexport:Base.start")].get("body_changed") is True
    assert report["summary"]["breaking"] == 7 and report["verdict"].startswith("7 uses break")
    md = api.markdown(report)
    assert "## Differences" in md and "`vllm:LLM`" in md


def test_cli_writes_both_reports_and_refuses_a_scratch_folder_inside_the_checkout(api, tmp_path: Path) -> None:
    old = write(tmp_path / "old", OLD)
    out = tmp_path / "out" / "vllm_api_9.9.9"
    rc = api.main(["--old-src", str(old), "--new-src", str(old), "--version", "9.9.9", "--out", str(out)])
    assert rc == 0
    report = json.loads((out.parent / "vllm_api_9.9.9.json").read_text())
    assert report["new_version"] == "vllm 9.9.9" and (out.parent / "vllm_api_9.9.9.md").is_file()
    with pytest.raises(SystemExit, match="inside the checkout"):
        api.fetch_wheel("9.9.9", ROOT / "build" / "wheels")


def test_functions_patched_by_name_are_checked(api, tmp_path: Path) -> None:
    """lynx_connector/vllm_fixes.py finds its targets by string (``_install(module, name, make, positional=N)``):
    a renamed target, or one that takes fewer positional arguments than the guard passes, is breaking."""
    old_files = {**OLD, "vllm/sampler.py": '''
        def top_k(logits, k, p=None):
            return logits
        def expand(x, cu, n, a=0, b=0):
            return x
    '''}
    plugin_files = {**PLUGIN, "lynx_connector/fixes.py": '''
        def _install(module, name, make, *, positional):
            return True
        def guards():
            _install("vllm.sampler", "top_k", None, positional=2)
            _install("vllm.sampler", "expand", None, positional=5)
    '''}
    old = write(tmp_path / "old", old_files)
    new = write(tmp_path / "new", {**old_files, "vllm/sampler.py": '''
        def apply_top_k(logits, k, p=None):
            return logits
        def expand(x, cu, n):
            return x
    '''})
    plugin = write(tmp_path / "plugin", plugin_files)
    same = _items(api.build_report(old, "old", old, "same", "cmd", root=plugin))
    assert same[("import", "vllm.sampler:top_k")]["status"] == "ok"
    assert same[("call", "vllm.sampler:expand")]["status"] == "ok"
    report = api.build_report(old, "old", new, "new", "cmd", root=plugin)
    items = _items(report)
    assert items[("import", "vllm.sampler:top_k")]["status"] != "ok"
    assert items[("call", "vllm.sampler:expand")]["status"] != "ok"
    assert report["summary"]["breaking"] >= 2
