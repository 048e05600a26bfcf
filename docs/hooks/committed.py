"""The generated blocks as committed: the forge shows README.md and the docs pages as they are
committed, so every `<!-- gen:NAME -->` block (markers.py) is written into them, up to its
`<!-- end:NAME -->` line, and tests/docs/test_docs.py fails when one differs from what the code
and the result files give now. The site renders the same blocks afresh (generated.py).

    python -m docs.hooks.committed          # rewrite every block from the code and result files
    python -m docs.hooks.committed --check  # exit 1 if a block is stale
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from docs.hooks.markers import Where, expand

REPO = Path(__file__).resolve().parents[2]
README = REPO / "README.md"
DOCS = REPO / "docs"
MAX_README_BYTES = 10 * 1024


def files() -> list[Path]:
    return [README, *sorted(DOCS.rglob("*.md"))]


def where(path: Path) -> Where:
    if path == README:
        return Where(outside_prefix="docs/", committed=True)
    page_dir = path.parent.relative_to(DOCS).as_posix()
    return Where("" if page_dir == "." else page_dir, committed=True)


def updated(path: Path) -> str:
    """The file's text with its blocks as the code and result files give them now."""
    return expand(path.read_text(), where(path))


def stale() -> list[Path]:
    return [path for path in files() if updated(path) != path.read_text()]


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--check", action="store_true", help="exit 1 if a block is stale")
    args = parser.parse_args()
    if args.check:
        old = stale()
        for path in old:
            print(f"{path.relative_to(REPO)}: stale; run python -m docs.hooks.committed", file=sys.stderr)
        return 1 if old else 0
    for path in files():
        text = updated(path)
        if text != path.read_text():
            path.write_text(text)
            print(f"{path.relative_to(REPO)}: rewritten")
    print(f"README.md: {len(README.read_bytes())} bytes (at most {MAX_README_BYTES})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
