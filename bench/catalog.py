"""Every benchmark, by group: a module of a group package (bench/<group>/) that runs as a command
is a benchmark named by its file. Read from the source, not imported: listing them must not load
torch or Ray."""

from __future__ import annotations

import ast
import re
from dataclasses import dataclass
from pathlib import Path

BENCH = Path(__file__).resolve().parent
GROUPS = ("engine", "serving", "fleet", "gpu", "quality")  # in the order `python -m bench` lists them
_MAIN_GUARD = re.compile(r'^if __name__ == "__main__":', re.MULTILINE)


@dataclass(frozen=True)
class Benchmark:
    name: str
    group: str
    summary: str  # the first line of the module's docstring

    @property
    def module(self) -> str:
        return f"bench.{self.group}.{self.name}"

    @property
    def path(self) -> Path:
        return BENCH / self.group / f"{self.name}.py"


def benchmarks() -> dict[str, Benchmark]:
    """Name -> benchmark, in the groups' order; a name is unique across groups."""
    found: dict[str, Benchmark] = {}
    for group in GROUPS:
        for path in sorted((BENCH / group).glob("*.py")):
            source = path.read_text()
            if not runs_as_command(source):
                continue
            if path.stem in found:
                raise ValueError(
                    f"benchmark name {path.stem!r} is in two groups: {found[path.stem].group}, {group}"
                )
            found[path.stem] = Benchmark(
                path.stem, group, _summary(ast.get_docstring(ast.parse(source)) or "")
            )
    return found


def runs_as_command(source: str) -> bool:
    return _MAIN_GUARD.search(source) is not None


def _summary(doc: str) -> str:
    """A docstring's first sentence, without the command it may start with."""
    text = re.sub(r"^`?python -m bench [^:]*:\s*", "", " ".join(doc.split()))
    first = re.split(r"(?<=[.?])\s", text, maxsplit=1)[0]
    return first[:1].upper() + first[1:]


def measures(group: str) -> str:
    """What a group measures: its package's docstring."""
    return ast.get_docstring(ast.parse((BENCH / group / "__init__.py").read_text())) or ""


def command(name: str) -> str:
    return f"python -m bench {name}"
