"""`make serve` installs only what serving needs (the `dev` extra is the tests', benchmarks' and
docs' tools), and serving runs without them: the app's modules import and the engine answers in
a process where importing any `dev`-only package fails."""

from __future__ import annotations

import subprocess
import sys
from importlib import metadata

from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

from harness.serve_cluster import REPO

SERVING = """
import importlib.abc, sys
BLOCKED = set(sys.argv[1:])

class NoDevPackages(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in BLOCKED:
            raise ImportError(f"{name} is a dev-only package")
        return None

sys.meta_path.insert(0, NoDevPackages())
import deployments.app, deployments.engine_replica, deployments.ingress
from replica_engine import LLM, SamplingParams
out = LLM(dtype="float32").generate("The capital of France is", SamplingParams(max_tokens=2))
print("answered:", out[0].outputs[0].text)
"""


def requirements(distribution: str, extra: str | None = None) -> set[str]:
    """The distributions `distribution` requires (with `extra`: that extra's only), by name."""
    found = set()
    for line in metadata.requires(distribution) or ():
        requirement = Requirement(line)
        wanted = {"extra": extra or ""}
        applies = requirement.marker is None or requirement.marker.evaluate(wanted)
        if applies and (extra is None or requirement.marker is not None):
            found.add(canonicalize_name(requirement.name))
    return found


def serving_closure() -> set[str]:
    """Every distribution the project needs to serve, transitively (not its extras)."""
    closure, todo = set(), ["stallfree"]
    while todo:
        name = todo.pop()
        if name in closure:
            continue
        closure.add(name)
        try:
            todo += requirements(name) - closure
        except metadata.PackageNotFoundError:  # an optional dependency not installed here
            continue
    return closure


def dev_only_modules() -> list[str]:
    """Top-level modules that only the `dev` extra brings (ray needs psutil: not blocked)."""
    dev = requirements("stallfree", "dev") - serving_closure()
    modules = metadata.packages_distributions()
    return sorted(m for m, dists in modules.items() if all(canonicalize_name(d) in dev for d in dists))


def test_make_serve_installs_no_dev_extra_and_make_test_does():
    def recipes(target: str) -> str:  # -n: print, do not run; -B: as from a clean clone
        return subprocess.run(
            ["make", "-n", "-B", target], cwd=REPO, capture_output=True, text=True, check=True
        ).stdout

    serve, test = recipes("serve"), recipes("test")
    assert "pip install -q -e ." in serve and "[dev]" not in serve
    assert "serve run serve_config.yaml" in serve
    assert 'pip install -q -e ".[dev]"' in test


def test_serving_runs_without_the_dev_packages():
    done = subprocess.run(
        [sys.executable, "-c", SERVING], cwd=REPO, capture_output=True, text=True, timeout=600
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert "answered:" in done.stdout
