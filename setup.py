"""Package layout: the repo's top-level folders install as subpackages of one `splitedge`.

The folders stay at the top of the repo (ARCHITECTURE.md's layout) and `package_dir` maps
each onto `splitedge.<folder>`, so the wheel puts a single name into site-packages and a
stale bare `import protocol` fails. Subpackages (one per method, ...) are found here, so a
new method package needs no edit of this file. Everything else lives in pyproject.toml.
The thin device wheel (no torch, no cloud or edge) is built from deploy/thin/, which picks its
modules from these folders.
"""

from setuptools import find_packages, setup

FOLDERS = ("protocol", "runtime", "device", "edge", "cloud", "models", "methods", "bench", "exporters")

setup(
    package_dir={"splitedge": "splitedge", **{f"splitedge.{f}": f for f in FOLDERS}},
    packages=["splitedge", *(f"splitedge.{sub}" for sub in find_packages("splitedge")), *(f"splitedge.{f}" for f in FOLDERS),
              *(f"splitedge.{f}.{sub}" for f in FOLDERS for sub in find_packages(f))],
)
