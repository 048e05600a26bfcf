"""Markdown tables from a benchmark's result file (bench/results/<stem>.json), never retyped.

A table is declared, not written: `Rows` (one row per child of a JSON path, `*` walking a level
and giving it a key column) or `Values` (one row per figure), each cell a `Col` naming a path
and a format. Paths are `/`-separated keys relative to the row (`""`: the row itself; a leading
`/`: from the file's root, `{0}`, `{1}`... standing for the row's keys). Where a path crosses a
list of per-seed records, it maps over them and `agg` folds the values (median, or median
[min-max]). A path the file lacks is an error, so a table cannot quietly go stale."""

from __future__ import annotations

import json
import statistics
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import Any

RESULTS = Path(__file__).resolve().parents[2] / "bench" / "results"
SPREAD_KEYS = frozenset({"median", "min", "max"})


class ResultError(ValueError):
    """A result file lacks what a table reads, or a table is malformed."""


@dataclass(frozen=True)
class Col:
    header: str
    path: str | tuple[str, ...]  # a tuple: several figures in one cell, joined by " / "
    fmt: str | tuple[str, ...] = "num"
    agg: str | None = None  # over per-seed lists: "median", "spread" (median [min-max]) or "each"
    best: str | None = None  # "min" or "max": the best row's cell in bold
    goal: str | None = None  # a goals_met key: its met/MISS mark follows the cell ...
    goal_row: str | None = None  # ... in this row only (None: every row)
    sep: str = " / "  # between a cell's figures
    ratio: bool = False  # the cell is path[0] / path[1] (per seed, then folded by agg)


@dataclass(frozen=True)
class Rows:
    id: str
    caption: str
    at: str  # a path to a dict or list whose children are the rows; `*` walks one more level
    keys: tuple[str, ...]  # key column headers: one per level, or one showing "a/b"; () for none
    cols: tuple[Col, ...]
    only: tuple[str, ...] | None = None  # row keys ("a/b" for two levels) to show, in this order
    labels: tuple[tuple[str, str], ...] = ()  # key ("a/b" with one key column) -> what it shows
    measured_only: bool = False  # leave out rows not measured in the run (a quoted peer's)


@dataclass(frozen=True)
class Values:
    id: str
    caption: str
    items: tuple[Col, ...]  # one row each: the header, then the figure


Table = Rows | Values


@dataclass(frozen=True)
class BenchSpec:
    """How one result file is shown: its page (relative to docs/), a line for the index, tables."""

    page: str
    title: str
    tables: tuple[Table, ...]


def load(stem: str) -> dict[str, Any]:
    path = RESULTS / f"{stem}.json"
    if not path.is_file():
        raise ResultError(f"no result file bench/results/{stem}.json")
    return json.loads(path.read_text())


def resolve(obj: Any, path: str, where: str) -> Any:
    """The value at `path` under `obj`; across a list of records, the list of their values."""
    for part in [p for p in path.split("/") if p]:
        if isinstance(obj, list) and not part.isdigit():
            return [resolve(item, part, where) for item in obj] if obj else []
        if isinstance(obj, list):
            if int(part) >= len(obj):
                raise ResultError(f"{where}: index {part} out of range in path {path!r}")
            obj = obj[int(part)]
        elif isinstance(obj, dict) and part in obj:
            obj = obj[part]
        else:
            raise ResultError(f"{where}: no key {part!r} in path {path!r}")
    return obj


def sig(value: float) -> str:
    """Three significant figures, thousands separated, never scientific."""
    size = abs(value)
    if size >= 1000:
        return f"{value:,.0f}"
    if size >= 100:
        return f"{value:.0f}"
    if size >= 10:
        return f"{value:.1f}"
    if size >= 1 or size == 0:
        return f"{value:.2f}"
    return f"{value:#.3g}"


def _ratio(value: float) -> str:
    return f"{value:.2f}" if 0.1 <= abs(value) < 10 else sig(value)


# Numeric formats: (scale, how the number is written, unit). A spread shows the unit once.
NUMERIC: dict[str, tuple[float, Callable[[float], str], str]] = {
    "num": (1, sig, ""),
    "int": (1, lambda v: f"{round(v):,}", ""),
    "s": (1, sig, " s"),
    "ms": (1000, sig, " ms"),
    "ms_value": (1, sig, " ms"),
    "us_value": (1, sig, " µs"),
    "x": (1, _ratio, "x"),
    "pct": (100, sig, "%"),
}
OTHER: dict[str, Callable[[Any], str]] = {
    "str": str,
    "yes": lambda v: "yes" if v else "no",
    "met": lambda v: "met" if v else "**MISS**",
    "slash": lambda v: "/".join(str(round(x)) for x in v),
    "range": lambda v: f"[{sig(v[0])}–{sig(v[1])}]",
    "list": lambda v: ", ".join(sig(x) if isinstance(x, int | float) else str(x) for x in v),
}


def _show(value: Any, fmt: str, unit: bool = True) -> str:
    if fmt in OTHER:
        return OTHER[fmt](value)
    scale, write, suffix = NUMERIC[fmt]
    return write(value * scale) + (suffix if unit else "")


def _spread(median: Any, low: Any, high: Any, fmt: str) -> str:
    return f"{_show(median, fmt)} [{_show(low, fmt, False)}–{_show(high, fmt, False)}]"


def _number(value: Any) -> float | None:
    if isinstance(value, bool) or value is None:
        return None
    if isinstance(value, int | float):
        return float(value)
    if isinstance(value, dict) and value.keys() >= SPREAD_KEYS:
        return _number(value["median"])
    return None


def _one(value: Any, fmt: str, agg: str | None, where: str) -> tuple[str, float | None]:
    """One figure as text, and as a number (to pick the best row) where it is one."""
    if fmt not in NUMERIC and fmt not in OTHER:
        raise ResultError(f"{where}: unknown format {fmt!r}")
    if value is None:
        return "—", None
    if isinstance(value, dict) and value.keys() >= SPREAD_KEYS:
        return _spread(value["median"], value["min"], value["max"], fmt), _number(value)
    if isinstance(value, list) and agg is not None:
        numbers = [v for v in value if v is not None]
        if not numbers:
            return "—", None
        if agg == "each":
            return ", ".join(_show(v, fmt) for v in numbers), None
        median = statistics.median(numbers)
        if agg == "median":
            return _show(median, fmt), float(median)
        if agg == "spread":
            return _spread(median, min(numbers), max(numbers), fmt), float(median)
        raise ResultError(f"{where}: unknown agg {agg!r}")
    return _show(value, fmt), _number(value)


def _cell(row: Any, keys: Sequence[str], col: Col, data: dict[str, Any], where: str):
    paths = col.path if isinstance(col.path, tuple) else (col.path,)
    try:
        values = [
            resolve(data, p.format(*keys), where) if p.startswith("/") else resolve(row, p, where)
            for p in paths
        ]
    except ResultError:
        if _measured_elsewhere(row):
            return "—", None  # a peer quoted from another run, or failed: only what it has
        raise
    if col.ratio:
        if len(values) != 2 or not isinstance(col.fmt, str):
            raise ResultError(f"{where}: ratio column {col.header!r} takes two paths and one format")
        top, bottom = values
        pairs = zip(top, bottom, strict=True) if isinstance(top, list) else [(top, bottom)]
        quotients = [a / b for a, b in pairs]
        values = [quotients if isinstance(top, list) else quotients[0]]
    fmts = col.fmt if isinstance(col.fmt, tuple) else (col.fmt,) * len(values)
    if len(fmts) != len(values):
        raise ResultError(f"{where}: column {col.header!r} has {len(values)} figures, {len(fmts)} formats")
    parts = [_one(value, fmt, col.agg, where) for value, fmt in zip(values, fmts, strict=True)]
    number = parts[0][1] if len(parts) == 1 else None
    if all(text == "—" for text, _ in parts):
        return "—", None
    return col.sep.join(text for text, _ in parts), number


def _measured_elsewhere(row: Any) -> bool:
    """A row whose server was not measured in this run (its `source` says why)."""
    source = row.get("source") if isinstance(row, dict) else None
    return isinstance(source, str) and not source.startswith("measured")


def _mark(text: str, col: Col, key: str, data: dict[str, Any], where: str) -> str:
    if col.goal is None or (col.goal_row is not None and key != col.goal_row):
        return text
    met = data.get("goals_met", {})
    if col.goal not in met:
        raise ResultError(f"{where}: no goals_met entry {col.goal!r}")
    return f"{text} ({OTHER['met'](met[col.goal])})"


def _rows(data: dict[str, Any], table: Rows, where: str) -> list[tuple[tuple[str, ...], Any]]:
    parts = [p for p in table.at.split("/") if p]
    if "*" not in parts:
        parts.append("*")
    found: list[tuple[tuple[str, ...], Any]] = [((), data)]
    for part in parts:
        if part != "*":
            found = [(keys, resolve(obj, part, where)) for keys, obj in found]
            continue
        walked = []
        for keys, obj in found:
            children = obj.items() if isinstance(obj, dict) else enumerate(obj)
            walked += [((*keys, str(k)), child) for k, child in children]
        found = walked
    if table.only is not None:
        by_key = {"/".join(keys): (keys, obj) for keys, obj in found}
        missing = [k for k in table.only if k not in by_key]
        if missing:
            raise ResultError(f"{where}: no rows {missing} at {table.at!r}")
        found = [by_key[k] for k in table.only]
    if table.measured_only:
        found = [(keys, obj) for keys, obj in found if not _measured_elsewhere(obj)]
    return found


def _markdown(header: Sequence[str], body: Sequence[Sequence[str]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(cell.replace("|", "\\|") for cell in row) + " |" for row in body]
    return "\n".join(lines)


def _captioned(caption: str, table: str) -> str:
    return f"{caption}\n\n{table}" if caption else table


def render_table(data: dict[str, Any], table: Table, stem: str, verdicts: bool = True) -> str:
    """The table's Markdown; `verdicts`: each goal's met/MISS beside its figure (benchmark pages;
    not the README's headline, whose reader follows the link for them)."""
    where = f"bench/results/{stem}.json, table {table.id!r}"
    mark = _mark if verdicts else lambda text, *_: text
    if isinstance(table, Values):
        body = []
        for col in table.items:
            text, _ = _cell(data, (), col, data, where)
            body.append([col.header, mark(text, col, "", data, where)])
        return _captioned(table.caption, _markdown(["figure", "value"], body))
    rows = _rows(data, table, where)
    labels = dict(table.labels)
    cells = [[_cell(obj, keys, col, data, where) for col in table.cols] for keys, obj in rows]
    for index, col in enumerate(table.cols):
        numbers = [row[index][1] for row in cells if row[index][1] is not None]
        if col.best and numbers:
            best = min(numbers) if col.best == "min" else max(numbers)
            for row in cells:
                if row[index][1] == best:
                    row[index] = (f"**{row[index][0]}**", best)
    body = []
    for (keys, _), row in zip(rows, cells, strict=True):
        key = "/".join(keys)
        if not table.keys:
            shown = []
        elif len(table.keys) == 1:
            shown = [labels.get(key, key)]
        elif len(table.keys) == len(keys):
            shown = [labels.get(k, k) for k in keys]
        else:
            raise ResultError(f"{where}: {len(keys)} row keys, {len(table.keys)} key headers")
        texts = [mark(text, col, key, data, where) for (text, _), col in zip(row, table.cols, strict=True)]
        body.append([*shown, *texts])
    header = [*table.keys, *(col.header for col in table.cols)]
    return _captioned(table.caption, _markdown(header, body))


def render_meta(data: dict[str, Any], stem: str) -> str:
    machine = data.get("machine", {})
    date = datetime.fromisoformat(data["date"]).strftime("%Y-%m-%d %H:%M UTC") if "date" in data else "?"
    run = f", {sig(data['run_s'] / 60)} min" if "run_s" in data else ""
    cpus = f" on {machine['cpu_count']} CPU cores" if "cpu_count" in machine else ""
    if machine.get("cpu_model"):  # the host's CPU can change between days
        cpus += f" of an {machine['cpu_model']} ({', '.join(machine['cpu_flags']) or 'no AVX-512'})"
    torch = f" (torch {machine['torch']})" if "torch" in machine else ""
    command = data.get("command", "?")
    return f"`bench/results/{stem}.json`: `{command}`, run {date}{cpus}{torch}{run}."


def goals_tally(data: dict[str, Any]) -> tuple[int, int]:
    met = data.get("goals_met", {})
    return sum(bool(v) for v in met.values()), len(met)


def render_goals(data: dict[str, Any]) -> str:
    met = data.get("goals_met", {})
    if not met:
        return "_No goal judged in this run._"
    goals = data.get("goals", {})
    targets = [goals.get(key) for key in met]
    with_target = any(target is not None for target in targets)
    body = []
    for (key, ok), target in zip(met.items(), targets, strict=True):
        row = [key if " " in key else f"`{key}`"]
        if with_target:
            row.append("" if target is None else str(target))
        body.append([*row, OTHER["met"](ok)])
    header = ["goal", "target", "result"] if with_target else ["goal", "result"]
    return _markdown(header, body)
