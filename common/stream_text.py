"""Text generated so far, read while more may come: a tail that could begin a tag (a tool call's,
`<think>`'s end) waits for the text after it, so that a stream never sends what a later piece
turns into markup."""

from __future__ import annotations


def held_back(text: str, tag: str) -> int:
    """How many characters at the end of `text` could begin `tag` (wait before sending them)."""
    for size in range(min(len(tag) - 1, len(text)), 0, -1):
        if tag.startswith(text[-size:]):
            return size
    return 0
