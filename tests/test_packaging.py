"""The wheel users install ships what the tests test: built as `pip wheel .` would build it (from a copy of the
checkout, so stale build/ output cannot leak in), it holds every module under lynx_connector/ and kernels/ (as
lynx_connector.kernels), nothing at top level but the package and its metadata, and every module in it imports
from the extracted wheel alone (not from the editable install the other tests use)."""

from __future__ import annotations

import os
import subprocess
import sys
import zipfile
from pathlib import Path, PurePosixPath

import pytest

from tests.wheelbuild import ROOT, build_wheel


def _source_modules() -> set[str]:
    """Wheel paths that the sources should produce: lynx_connector/**.py and kernels/**.py (shipped under
    lynx_connector/kernels/)."""
    out = {p.relative_to(ROOT).as_posix() for p in (ROOT / "lynx_connector").rglob("*.py")
           if "__pycache__" not in p.parts}
    out |= {"lynx_connector/kernels/" + p.relative_to(ROOT / "kernels").as_posix()
            for p in (ROOT / "kernels").rglob("*.py") if "__pycache__" not in p.parts}
    return out


@pytest.fixture(scope="module")
def wheel(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_wheel(tmp_path_factory.mktemp("wheel"))


@pytest.fixture(scope="module")
def names(wheel: Path) -> list[str]:
    with zipfile.ZipFile(wheel) as zf:
        return zf.namelist()


def test_every_package_directory_is_in_the_wheel(names: list[str]) -> None:
    dirs = {str(PurePosixPath(n).parent) for n in names}
    expected = {str(PurePosixPath(m).parent) for m in _source_modules()} | {"lynx_connector/kernels"}
    assert expected <= dirs, f"package directories missing from the wheel: {sorted(expected - dirs)}"


def test_wheel_modules_equal_the_sources(names: list[str]) -> None:
    shipped = {n for n in names if n.endswith(".py")}
    sources = _source_modules()
    assert shipped == sources, (f"missing from the wheel: {sorted(sources - shipped)}; "
                                f"in the wheel but not in the sources: {sorted(shipped - sources)}")


def test_every_shipped_directory_is_a_regular_package(names: list[str]) -> None:
    shipped = set(names)
    dirs = {str(PurePosixPath(n).parent) for n in names if n.endswith(".py")}
    assert all(f"{d}/__init__.py" in shipped for d in dirs), (
        f"directories without __init__.py: {sorted(d for d in dirs if f'{d}/__init__.py' not in shipped)}")


def test_nothing_but_the_package_at_top_level(names: list[str]) -> None:
    top = {n.split("/", 1)[0] for n in names}
    assert not any(n.startswith(("kernels/", "tests/")) for n in names)
    assert {t for t in top if not t.endswith(".dist-info")} == {"lynx_connector"}, top


def test_entry_points_are_declared(names: list[str], wheel: Path) -> None:
    entry_points = next(n for n in names if n.endswith(".dist-info/entry_points.txt"))
    with zipfile.ZipFile(wheel) as zf:
        text = zf.read(entry_points).decode()
    assert "lynx = lynx_connector.cli:main" in text
    assert "lynx = lynx_connector.plugin:register" in text


def test_metadata_carries_the_license_and_the_package_version(names: list[str], wheel: Path) -> None:
    """The wheel ships the license text it declares (Apache-2.0), and its version is lynx_connector.__version__
    (set in two places: pyproject.toml and the package)."""
    import lynx_connector

    assert any(n.endswith(".dist-info/licenses/LICENSE") for n in names), names
    metadata = next(n for n in names if n.endswith(".dist-info/METADATA"))
    with zipfile.ZipFile(wheel) as zf:
        text = zf.read(metadata).decode()
    assert f"\nVersion: {lynx_connector.__version__}\n" in text
    assert "\nLicense-Expression: Apache-2.0\n" in text


def _module_name(path: str) -> str:
    parts = list(PurePosixPath(path).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def test_every_module_imports_from_the_wheel(wheel: Path, names: list[str],
                                             tmp_path_factory: pytest.TempPathFactory) -> None:
    """Each module of the wheel imports in a fresh interpreter whose only copy of lynx_connector is the
    extracted wheel (cwd outside the checkout; every imported module's file is checked to lie in it)."""
    site = tmp_path_factory.mktemp("site")
    with zipfile.ZipFile(wheel) as zf:
        zf.extractall(site)
    # a __main__ module runs its program when imported (tests/test_wheel_install.py finds and compiles it)
    modules = sorted(_module_name(n) for n in names if n.endswith(".py") and not n.endswith("/__main__.py"))
    assert "lynx_connector.connector" in modules and "lynx_connector.speculative.scheduler" in modules
    code = (
        "import importlib, os, sys, traceback\n"
        "site, modules = os.path.realpath(sys.argv[1]) + os.sep, sys.argv[2:]\n"
        "bad = []\n"
        "for name in modules:\n"
        "    try:\n"
        "        mod = importlib.import_module(name)\n"
        "    except BaseException:\n"
        "        bad.append(f'{name}: ' + traceback.format_exc(limit=3))\n"
        "        continue\n"
        "    if not os.path.realpath(getattr(mod, '__file__', None) or '?').startswith(site):\n"
        "        bad.append(f'{name}: imported from {mod.__file__}, not from the wheel')\n"
        "print('\\n'.join(bad))\n"
        "sys.exit(1 if bad else 0)\n"
    )
    env = {k: v for k, v in os.environ.items() if not k.startswith("PYTHON")}
    env["PYTHONPATH"] = str(site)
    cwd = tmp_path_factory.mktemp("cwd")
    proc = subprocess.run([sys.executable, "-c", code, str(site), *modules], cwd=cwd, env=env,
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, f"modules that do not import from the wheel:\n{proc.stdout}\n{proc.stderr[-4000:]}"
