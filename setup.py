"""Package discovery; everything else about the distribution is in pyproject.toml.

pyproject.toml alone cannot combine automatic discovery with shipping the top-level ``kernels/`` directory as
``lynx_connector.kernels``, so the package list is computed here, never written by hand: every directory under
``lynx_connector/`` (namespace discovery: a directory of modules is shipped even if it lacks ``__init__.py``),
plus ``kernels/`` and its subdirectories under ``lynx_connector.kernels``. Nothing is shipped as a top-level
``kernels`` (or ``tests``) module. tests/test_packaging.py builds the wheel and checks all of this.
"""

from setuptools import find_namespace_packages, setup

PYCACHE = ["__pycache__", "*.__pycache__"]

packages = find_namespace_packages(include=["lynx_connector", "lynx_connector.*"], exclude=PYCACHE)
packages += ["lynx_connector.kernels"] + [
    f"lynx_connector.kernels.{name}" for name in find_namespace_packages("kernels", exclude=PYCACHE)
]

setup(packages=packages, package_dir={"lynx_connector.kernels": "kernels"})
