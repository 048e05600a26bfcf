"""`<!-- gen:NAME -->` markers: a line holding exactly one, and the block after it up to the line
`<!-- end:NAME -->` if there is one, is replaced by the Markdown NAME generates. The files are
committed with each block written out (committed.py), so the forge shows them too; the site
renders them afresh. Names:

- `settings:AppArgs`, `settings:EngineConfig`: the settings tables (settings.py)
- `metrics`: every metric the code declares (metrics.py)
- `bench:<stem>`: everything about `bench/results/<stem>.json`: its run, goals, tables and plot;
  or one part: `bench-meta:<stem>`, `bench-goals:<stem>`, `bench-table:<stem>:<table id>`,
  `bench-plot:<stem>` (the PNG beside the result file)
- `bench-index`: every result file, its page and how many goals it met
- `readme-headline`: the README's headline (the CPU serving table and the benchmark index)

An unknown name is an error (UnknownMarker), which fails the docs build."""

from __future__ import annotations

import posixpath
import re
from dataclasses import dataclass

from docs.hooks import bench_tables, metrics, settings
from docs.hooks.bench_specs import ENGINE_SPECS
from docs.hooks.bench_specs_capacity import CAPACITY_SPECS
from docs.hooks.bench_specs_disaggregation import DISAGGREGATION_SPECS
from docs.hooks.bench_specs_fleet import FLEET_SPECS
from docs.hooks.bench_specs_gpu import GPU_SPECS
from docs.hooks.bench_specs_serving import SERVING_SPECS
from docs.hooks.bench_tables import BenchSpec

# a marker line, and its block as committed (up to its end line), if written out
MARKER = re.compile(r"^<!-- gen:(?P<name>\S+) -->$(?:\n(?:.*?\n)?<!-- end:(?P=name) -->$)?", re.M | re.S)
SPECS: dict[str, BenchSpec] = {
    **ENGINE_SPECS,
    **CAPACITY_SPECS,
    **SERVING_SPECS,
    **FLEET_SPECS,
    **GPU_SPECS,
    **DISAGGREGATION_SPECS,
}
PLOTS_DIR = "benchmarks/img"  # where the site serves bench/results/*.png (generated.py copies them)
HEADLINE_STEM = "cpu_serving"


class UnknownMarker(ValueError):
    """A `gen:` marker names nothing the generators know."""


@dataclass(frozen=True)
class Where:
    """Where generated Markdown lands: a docs page (its directory, relative to docs/) or a file
    outside the site (links then point into docs/ from `prefix`, and plots are left out).
    `committed`: the page's text as committed, read on the forge, where the site's plots
    directory does not exist (plots link to bench/results/ instead)."""

    page_dir: str = ""
    outside_prefix: str | None = None
    committed: bool = False

    def link(self, target: str) -> str:
        if self.outside_prefix is not None:
            return self.outside_prefix + target
        return posixpath.relpath(target, self.page_dir or ".")

    def plot_link(self, stem: str) -> str:
        if self.committed:
            return posixpath.relpath(f"bench/results/{stem}.png", posixpath.join("docs", self.page_dir))
        return self.link(f"{PLOTS_DIR}/{stem}.png")


def _spec(stem: str) -> BenchSpec:
    if stem not in SPECS:
        raise UnknownMarker(f"no table spec for bench/results/{stem}.json (docs/hooks/bench_specs*.py)")
    return SPECS[stem]


def plot(stem: str, where: Where) -> str:
    if not (bench_tables.RESULTS / f"{stem}.png").is_file():
        raise UnknownMarker(f"no plot bench/results/{stem}.png")
    return f"![bench/results/{stem}.png]({where.plot_link(stem)})"


def bench(stem: str, where: Where) -> str:
    spec = _spec(stem)
    data = bench_tables.load(stem)
    parts = [bench_tables.render_meta(data, stem), bench_tables.render_goals(data)]
    parts += [bench_tables.render_table(data, table, stem) for table in spec.tables if table.caption]
    if (bench_tables.RESULTS / f"{stem}.png").is_file() and where.outside_prefix is None:
        parts.append(plot(stem, where))
    return "\n\n".join(parts)


def bench_table(stem: str, table_id: str, verdicts: bool = True) -> str:
    tables = {table.id: table for table in _spec(stem).tables}
    if table_id not in tables:
        raise UnknownMarker(f"no table {table_id!r} for {stem}; known: {sorted(tables)}")
    return bench_tables.render_table(bench_tables.load(stem), tables[table_id], stem, verdicts)


def bench_index(where: Where, tallies: bool = True) -> str:
    """Every result file and its page; with `tallies`, how many of its goals it met (the
    benchmark pages' index, not the README's)."""
    header = ["benchmark", "result file", "run", *(["goals met"] if tallies else [])]
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for stem, spec in sorted(SPECS.items(), key=lambda item: (item[1].page, item[0])):
        data = bench_tables.load(stem)
        cells = [f"[{spec.title}]({where.link(spec.page)})", f"`{stem}.json`", data.get("date", "?")[:10]]
        if tallies:
            met, total = bench_tables.goals_tally(data)
            missed = f" ({total - met} **MISS**)" if met < total else ""
            cells.append(f"{met} of {total}{missed}" if total else "none judged")
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def readme_headline(where: Where) -> str:
    """The README's figures (and the docs home's): no verdicts, which live on the benchmark pages."""
    data = bench_tables.load(HEADLINE_STEM)
    page = where.link(SPECS[HEADLINE_STEM].page)
    date = data.get("date", "?")[:10]
    return "\n\n".join(
        [
            f"Serving over HTTP on a 2-core CPU, beside the servers a CPU user would run instead "
            f"(`bench/results/{HEADLINE_STEM}.json`, run {date}; "
            f"[how it is measured, and its goals]({page})):",
            bench_table(HEADLINE_STEM, "headline", verdicts=False),
            f"Every benchmark, each page with its goals ([the index]({where.link('benchmarks/index.md')})):",
            bench_index(where, tallies=False),
        ]
    )


def render(name: str, where: Where) -> str:
    kind, _, arg = name.partition(":")
    if kind == "settings" and arg in settings.SETTINGS:
        return settings.render(arg)
    if name == "metrics":
        return metrics.render()
    if name == "bench-index":
        return bench_index(where)
    if name == "readme-headline":
        return readme_headline(where)
    if kind == "bench" and arg:
        return bench(arg, where)
    if kind in ("bench-meta", "bench-goals") and arg:
        _spec(arg)
        data = bench_tables.load(arg)
        return (
            bench_tables.render_meta(data, arg) if kind == "bench-meta" else bench_tables.render_goals(data)
        )
    if kind == "bench-table" and ":" in arg:
        return bench_table(*arg.split(":", 1))
    if kind == "bench-plot" and arg:
        return plot(arg, where)
    raise UnknownMarker(f"unknown generated name {name!r} (docs/hooks/markers.py lists the names)")


def expand(markdown: str, where: Where) -> str:
    """`markdown` with every marker (and its block) replaced by what it names: as a block between
    its marker lines where `where.committed`, else the Markdown alone (the site's)."""

    def block(match: re.Match[str]) -> str:
        name = match.group("name")
        body = render(name, where)
        return f"<!-- gen:{name} -->\n{body}\n<!-- end:{name} -->" if where.committed else body

    return MARKER.sub(block, markdown)


def names_in(markdown: str) -> list[str]:
    return [match.group("name") for match in MARKER.finditer(markdown)]
