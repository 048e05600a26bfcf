"""The docs cannot drift from the code or the result files: every setting and metric carries a
description, every `<!-- gen:NAME -->` marker names something the generators know, every result
file is shown on a page, and the README (which GitHub shows as committed) is small and holds the
headline the current result files give. `make test` also builds the site with `mkdocs --strict`
(broken links, pages missing from the nav); this file needs no Ray cluster and no build."""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path

import pytest
import yaml
from pydantic import BaseModel, Field

from docs.hooks import committed, metrics, settings
from docs.hooks.bench_tables import RESULTS
from docs.hooks.markers import SPECS, UnknownMarker, Where, expand, names_in, render

REPO = Path(__file__).resolve().parents[2]
DOCS = REPO / "docs"
DECLARES_METRICS = re.compile(r"\bsink\.(counter|gauge|histogram)\(")
SKIP_DIRS = {".venv", ".git", "tests", "docs", "build", ".site"}


def pages() -> list[Path]:
    return sorted(p for p in DOCS.rglob("*.md") if "hooks" not in p.parts)


def test_every_setting_has_a_description_in_its_table() -> None:
    from deployments.app_args import AppArgs
    from replica_engine.config import EngineConfig

    app = settings.render("AppArgs")
    engine = settings.render("EngineConfig")
    for name in AppArgs.model_fields:
        assert f"| `{name}` |" in app
    for field in dataclasses.fields(EngineConfig):
        assert f"| `{field.name}` |" in engine


def test_a_setting_without_a_description_fails(monkeypatch: pytest.MonkeyPatch) -> None:
    import deployments.app_args
    import replica_engine.config

    class Undocumented(BaseModel):
        documented: int = Field(default=1, description="has one")
        new_knob: int = 2

    monkeypatch.setattr(deployments.app_args, "AppArgs", Undocumented)
    with pytest.raises(settings.MissingDescription, match="new_knob"):
        settings.app_args_rows()

    @dataclasses.dataclass
    class UndocumentedEngine:
        new_knob: int = 3

    monkeypatch.setattr(replica_engine.config, "EngineConfig", UndocumentedEngine)
    with pytest.raises(settings.MissingDescription, match="new_knob"):
        settings.engine_config_rows()


def test_every_metric_has_a_description() -> None:
    declared = metrics.collect()
    names = [metric.name for metric in declared]
    assert len(names) == len(set(names))
    assert {"stallfree_time_to_first_token_seconds", "stallfree_router_requests_routed"} <= set(names)
    table = metrics.render()
    for metric in declared:
        assert metric.description.strip()
        assert f"`{metric.exported}`" in table


def test_a_metric_without_a_description_fails(monkeypatch: pytest.MonkeyPatch) -> None:
    def declare(sink: metrics.RecordingSink) -> None:
        sink.gauge("stallfree_new_gauge", "", ("model_name",))

    monkeypatch.setattr(metrics, "SOURCES", {**metrics.SOURCES, "somewhere.py": declare})
    with pytest.raises(metrics.MissingDescription, match="stallfree_new_gauge"):
        metrics.collect()


def test_every_module_declaring_metrics_is_a_source() -> None:
    """A new module declaring metrics must be listed in docs/hooks/metrics.py's SOURCES."""
    declaring = set()
    for path in REPO.rglob("*.py"):
        relative = path.relative_to(REPO)
        if SKIP_DIRS.intersection(relative.parts[:1]) or any(p.startswith(".") for p in relative.parts):
            continue
        if DECLARES_METRICS.search(path.read_text(errors="replace")):
            declaring.add(relative.as_posix())
    assert declaring, "the pattern found no metric declarations at all"
    assert declaring <= set(metrics.SOURCES), (
        f"not in metrics.SOURCES: {sorted(declaring - set(metrics.SOURCES))}"
    )
    for source in metrics.SOURCES:
        assert (REPO / source).is_file(), source


@pytest.mark.parametrize(
    "name",
    [
        "bogus",
        "settings:Nope",
        "bench:no_such_file",
        "bench-table:offline_cpu:nope",
        "bench-plot:dtype_agreement",
    ],
)
def test_an_unknown_name_fails(name: str) -> None:
    with pytest.raises(UnknownMarker):
        render(name, Where())
    with pytest.raises(UnknownMarker):
        expand(f"text\n<!-- gen:{name} -->\nmore", Where())


def test_every_marker_in_the_docs_renders() -> None:
    used = set()
    for page in pages():
        text = page.read_text()
        page_dir = page.parent.relative_to(DOCS).as_posix()
        expanded = expand(text, Where("" if page_dir == "." else page_dir))
        assert not names_in(expanded), page
        used.update(names_in(text))
    assert {"settings:AppArgs", "settings:EngineConfig", "metrics"} <= used


def test_every_page_is_in_the_nav() -> None:
    """(`mkdocs build --strict` in `make test` says the same; this runs in `make test-fast` too.)"""

    class Loader(yaml.SafeLoader):
        pass

    Loader.add_multi_constructor("tag:", lambda loader, suffix, node: None)
    Loader.add_multi_constructor("!", lambda loader, suffix, node: None)  # !ENV
    config = yaml.load((REPO / "mkdocs.yml").read_text(), Loader=Loader)

    def listed(nav: object) -> list[str]:
        if isinstance(nav, str):
            return [nav]
        if isinstance(nav, list):
            return [page for item in nav for page in listed(item)]
        if isinstance(nav, dict):
            return [page for value in nav.values() for page in listed(value)]
        return []

    in_nav = listed(config["nav"])
    on_disk = [page.relative_to(DOCS).as_posix() for page in pages()]
    assert sorted(in_nav) == sorted(on_disk)


def test_every_result_file_is_shown_on_its_page() -> None:
    stems = sorted(path.stem for path in RESULTS.glob("*.json"))
    assert stems
    assert set(stems) == set(SPECS), "each bench/results/*.json needs a spec in docs/hooks/bench_specs*.py"
    for stem in stems:
        page = DOCS / SPECS[stem].page
        assert page.is_file(), page
        marked = {name.split(":")[1] for name in names_in(page.read_text()) if name.startswith("bench")}
        assert stem in marked, f"{page} shows nothing of {stem}.json"


def test_readme_is_short() -> None:
    assert len(committed.README.read_bytes()) <= committed.MAX_README_BYTES


def test_committed_blocks_are_what_the_code_and_result_files_give() -> None:
    """The forge shows the files as committed: each generated block is written out, and current."""
    assert "<!-- end:readme-headline -->" in committed.README.read_text()
    assert [path.name for path in committed.stale()] == [], "stale: run python -m docs.hooks.committed"


def test_committed_plots_link_to_the_result_files() -> None:
    text = (DOCS / SPECS["offline_cpu"].page).read_text()
    links = re.findall(r"!\[[^]]*\]\(([^)]+\.png)\)", text)
    assert links
    for link in links:
        assert (DOCS / SPECS["offline_cpu"].page).parent.joinpath(link).resolve().is_file(), link


def test_readme_links_into_the_docs_exist() -> None:
    links = re.findall(r"\]\((docs/[^)#]+)", committed.README.read_text())
    assert links
    for link in links:
        assert (REPO / link).is_file(), link
