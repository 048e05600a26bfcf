"""`python -m bench NAME [ARGS]`: runs one benchmark (its own --help says how); `python -m bench`
lists them by group."""

from __future__ import annotations

import runpy
import sys

from bench.catalog import GROUPS, benchmarks, command, measures


def listing() -> str:
    found = benchmarks()
    lines = ["usage: python -m bench NAME [ARGS]   (python -m bench NAME --help for its own)"]
    for group in GROUPS:
        lines += ["", f"{group}: {measures(group)}"]
        lines += [f"  {b.name:<26} {b.summary}" for b in found.values() if b.group == group]
    return "\n".join(lines)


def main(argv: list[str]) -> int:
    if not argv or argv[0] in ("-h", "--help"):
        print(listing())
        return 0
    found = benchmarks()
    if argv[0] not in found:
        print(f"no benchmark named {argv[0]!r}; one of: {', '.join(found)}", file=sys.stderr)
        return 2
    benchmark = found[argv[0]]
    sys.argv = [command(benchmark.name), *argv[1:]]
    runpy.run_module(benchmark.module, run_name="__main__", alter_sys=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
