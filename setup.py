"""Package discovery for psring; all other metadata is in pyproject.toml.

workers/ and servers/ live at the top of the repository (the design card's layout) but
are installed as psring.workers and psring.servers, so they cannot clash with a user's
own top-level `workers` or `servers` module (docs/architecture.md). Packages are
discovered, never listed by hand: a hand-written list once left psring.zoo out of the
wheel, which tests/package/test_wheel.py now builds and installs to catch.
"""
from setuptools import find_packages, setup

MAPPED = {"psring.workers": "workers", "psring.servers": "servers"}

packages = find_packages(include=["psring", "psring.*"])
package_dir = {"psring": "psring"}
for name, where in MAPPED.items():
    packages += [name] + [f"{name}.{sub}" for sub in find_packages(where)]
    package_dir[name] = where

# compare.toml is `psring compare`'s definition (psring.runs.compare)
setup(packages=packages, package_dir=package_dir, package_data={"psring.runs": ["*.toml"]})
