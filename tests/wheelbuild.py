"""Build the wheel as a user would (`pip wheel --no-deps .`) and install it into a fresh virtual environment.

Shared by tests/test_packaging.py (what the wheel holds) and tests/test_wheel_install.py (the installed wheel
imports and serves). The wheel is built from a copy of the checkout, so stale build/ output cannot leak in.

The fresh environment reuses the project venv's installed dependencies instead of reinstalling them: the wheel
goes in with ``pip install --no-deps`` (non-editable), and then a ``.pth`` file adds the project venv's
site-packages directory to ``sys.path`` *after* the fresh environment's own. A directory named in a ``.pth``
file is only appended to ``sys.path``; the ``.pth`` files inside it are not run, so the project venv's
``__editable__*.pth`` (which installs the editable finder for the checkout) never loads there: the only
``lynx_connector`` the fresh interpreter can import is the installed wheel.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import sysconfig
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
#: Checkout entries that are not sources (virtual environment, VCS, build output).
NOT_SOURCES = {".git", ".venv", "build", "dist", ".pytest_cache", ".ruff_cache", ".hypothesis"}
#: The .pth file that lends the project venv's dependencies to the fresh environment.
DEPS_PTH = "_lynx_project_deps.pth"


def _ignore(directory: str, names: list[str]) -> set[str]:
    skip = {n for n in names if n == "__pycache__" or n.endswith((".pyc", ".egg-info"))}
    if Path(directory).resolve() == ROOT:
        skip |= NOT_SOURCES & set(names)
    return skip


def build_wheel(tmp: Path) -> Path:
    """``pip wheel --no-deps --no-build-isolation`` of a copy of the checkout; the one wheel it made."""
    src, dist = tmp / "src", tmp / "dist"
    shutil.copytree(ROOT, src, ignore=_ignore, symlinks=True)
    proc = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation",
                           "--disable-pip-version-check", "-q", "-w", str(dist), "."],
                          cwd=src, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, f"pip wheel failed:\n{proc.stdout}\n{proc.stderr}"
    wheels = sorted(dist.glob("lynx_connector-*.whl"))
    assert len(wheels) == 1, wheels
    return wheels[0]


def clean_env(**extra: str) -> dict[str, str]:
    """This process's environment without PYTHON* variables (no PYTHONPATH pointing into the checkout)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("PYTHON")}
    env.update(extra)
    return env


def project_site_dirs() -> list[str]:
    """The project venv's site-packages directories (purelib, platlib), the ones the fresh venv borrows."""
    return list(dict.fromkeys(sysconfig.get_path(k) for k in ("purelib", "platlib")))


def fresh_venv(wheel: Path, venv: Path) -> Path:
    """A new virtual environment at ``venv`` with ``wheel`` installed non-editable and the project venv's
    dependencies lent by a ``.pth`` file; returns its site-packages directory."""
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True, timeout=120)
    py = venv / "bin" / "python"
    # The project venv's pip installs into the new interpreter (--python); the wheel goes in before the .pth
    # exists, so pip sees an empty environment (it cannot touch the project venv's editable install).
    proc = subprocess.run([sys.executable, "-m", "pip", "--python", str(py), "install", "--no-deps", "--no-index",
                           "--disable-pip-version-check", "--no-warn-script-location", "-q", str(wheel)],
                          capture_output=True, text=True, timeout=300, env=clean_env())
    assert proc.returncode == 0, f"pip install --no-deps of the wheel failed:\n{proc.stdout}\n{proc.stderr}"
    site = Path(subprocess.run([str(py), "-c", "import sysconfig; print(sysconfig.get_path('purelib'))"],
                               capture_output=True, text=True, check=True, env=clean_env()).stdout.strip())
    assert (site / "lynx_connector" / "__init__.py").is_file(), f"the wheel did not land in {site}"
    (site / DEPS_PTH).write_text("".join(d + "\n" for d in project_site_dirs()))
    return site
