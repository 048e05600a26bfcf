"""README.md's generated block: GitHub shows the README as it is committed, so its headline
(markers.py's `readme-headline`, from bench/results/) is written into it between two marker lines
and tests/docs/test_docs.py fails when it differs from what the result files give now.

    python -m docs.hooks.readme          # rewrite the block from the current result files
    python -m docs.hooks.readme --check  # exit 1 if the block is stale
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from docs.hooks.markers import Where, render

README = Path(__file__).resolve().parents[2] / "README.md"
NAME = "readme-headline"
BEGIN = f"<!-- gen:{NAME} -->"
END = f"<!-- end:{NAME} -->"
MAX_BYTES = 10 * 1024


def block() -> str:
    """The block as the result files give it now, marker lines included."""
    return f"{BEGIN}\n{render(NAME, Where(outside_prefix='docs/'))}\n{END}"


def current(text: str) -> str:
    if text.count(BEGIN) != 1 or text.count(END) != 1 or text.index(BEGIN) > text.index(END):
        raise ValueError(f"README.md must hold exactly one {BEGIN} ... {END} block")
    return text[text.index(BEGIN) : text.index(END) + len(END)]


def updated(text: str) -> str:
    return text.replace(current(text), block())


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--check", action="store_true", help="exit 1 if README.md's block is stale")
    args = parser.parse_args()
    text = README.read_text()
    new = updated(text)
    if args.check:
        if new != text:
            print("README.md's generated block is stale: run python -m docs.hooks.readme", file=sys.stderr)
            return 1
        return 0
    README.write_text(new)
    print(f"README.md: {len(new.encode())} bytes (at most {MAX_BYTES})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
