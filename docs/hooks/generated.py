"""The MkDocs hook (mkdocs.yml `hooks:`): expands `<!-- gen:NAME -->` markers (markers.py) in
every page, and serves bench/results/*.png under benchmarks/img/ for the benchmark pages."""

from __future__ import annotations

import posixpath
import sys
from pathlib import Path
from typing import TYPE_CHECKING

REPO = Path(__file__).resolve().parents[2]
if str(REPO) not in sys.path:  # `mkdocs` run as a script has the repository root nowhere on it
    sys.path.insert(0, str(REPO))

from mkdocs.exceptions import PluginError  # noqa: E402
from mkdocs.structure.files import File, Files  # noqa: E402

from docs.hooks.bench_tables import RESULTS, ResultError  # noqa: E402
from docs.hooks.markers import PLOTS_DIR, UnknownMarker, Where, expand  # noqa: E402

if TYPE_CHECKING:
    from mkdocs.config.defaults import MkDocsConfig
    from mkdocs.structure.pages import Page


def on_files(files: Files, config: MkDocsConfig) -> Files:
    for png in sorted(RESULTS.glob("*.png")):
        files.append(File.generated(config, f"{PLOTS_DIR}/{png.name}", abs_src_path=str(png)))
    return files


def on_page_markdown(markdown: str, page: Page, config: MkDocsConfig, files: Files) -> str:
    where = Where(page_dir=posixpath.dirname(page.file.src_uri))
    try:
        return expand(markdown, where)
    except (UnknownMarker, ResultError) as error:
        raise PluginError(f"{page.file.src_uri}: {error}") from error
