"""The layers hold: no package imports one above it, and nothing shipped imports tests or docs.

common <- replica_engine; common <- router <- deployments; replica_engine, router <- fleet_sim;
everything shipped <- harness (test infrastructure) <- bench. Every import counts, top-level,
inside a function or under TYPE_CHECKING: a lazy import is still a dependency."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

# What each shipped package may import besides itself and third-party packages; the packages
# not shipped (tests, docs) may import anything.
ALLOWED: dict[str, set[str]] = {
    "common": set(),
    "replica_engine": {"common"},
    "router": {"common"},
    "deployments": {"common", "replica_engine", "router"},
    "fleet_sim": {"common", "replica_engine", "router"},
    "harness": {"common", "replica_engine", "router", "deployments", "fleet_sim"},
    "bench": {"common", "replica_engine", "router", "deployments", "fleet_sim", "harness"},
}
NOT_SHIPPED = {"tests", "docs"}  # pyproject.toml's packages.find includes the others
OURS = set(ALLOWED) | NOT_SHIPPED


def imported_packages(tree: ast.AST) -> list[tuple[int, str]]:
    """(line, module) for every absolute import in the tree; relative ones stay in their package."""
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            found.append((node.lineno, node.module))
    return found


def layer_violations(package: str) -> list[str]:
    allowed = ALLOWED[package] | {package}
    violations = []
    for path in sorted((ROOT / package).rglob("*.py")):
        for line, module in imported_packages(ast.parse(path.read_text(), str(path))):
            top = module.split(".")[0]
            if top in OURS and top not in allowed:
                violations.append(f"{path.relative_to(ROOT)}:{line} imports {module}")
    return violations


def test_every_package_is_in_a_layer():
    packages = {path.parent.name for path in ROOT.glob("*/__init__.py")}
    assert packages <= OURS, "a new package needs its place in ALLOWED or NOT_SHIPPED"


def test_no_package_imports_a_layer_above_it():
    violations = [v for package in ALLOWED for v in layer_violations(package)]
    assert not violations, "imports across the layers:\n" + "\n".join(violations)
