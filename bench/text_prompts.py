"""Prompts of real English text, with no download: the prose of the Python standard library's
docstrings (paragraphs without code), cut into token windows at seeded offsets. The same Python
version gives the same text; result files record the version."""

from __future__ import annotations

import functools
import importlib
import inspect
import random

# Modules whose docstrings are mostly prose.
MODULES = (
    "argparse", "asyncio.events", "asyncio.locks", "bisect", "calendar", "collections", "concurrent.futures",
    "contextlib", "csv", "dataclasses", "datetime", "decimal", "difflib", "email.message", "enum",
    "fractions", "functools", "heapq", "http.client", "inspect", "io", "itertools", "json", "logging",
    "pathlib", "pickle", "queue", "random", "sched", "shutil", "socket", "sqlite3", "ssl", "statistics",
    "string", "subprocess", "tarfile", "tempfile", "textwrap", "threading", "typing", "unittest.case",
    "urllib.request", "zipfile",
)  # fmt: skip


def _docstrings(module_name: str) -> list[str]:
    module = importlib.import_module(module_name)
    objects = [module, *(obj for _, obj in sorted(vars(module).items()))]
    docs = []
    for obj in objects:
        defined_here = obj is module or getattr(obj, "__module__", None) == module.__name__
        if defined_here and (obj is module or inspect.isclass(obj) or inspect.isfunction(obj)):
            docs.append(inspect.getdoc(obj) or "")
    return docs


def _is_prose(paragraph: str) -> bool:
    words = paragraph.split()
    code_marks = (">>>", "...", "::", "{", "}", "=", "(", ")")
    return (
        len(words) >= 12
        and not any(mark in paragraph for mark in code_marks[:3])
        and sum(any(mark in word for mark in code_marks) for word in words) < len(words) / 10
    )


CHARS_PER_TOKEN = 4.4  # of this English text through SmolLM2's tokenizer (measured, for sizing only)


@functools.cache
def english_text() -> str:
    paragraphs = []
    for module_name in MODULES:
        for doc in _docstrings(module_name):
            paragraphs += [" ".join(p.split()) for p in doc.split("\n\n") if _is_prose(p)]
    return "\n\n".join(dict.fromkeys(paragraphs))  # each paragraph once, in a fixed order


def text_prompts(tokenizer, lengths: list[int], seed: int) -> list[list[int]]:
    """One window of the text per length, each at a seeded random offset."""
    ids = tokenizer.encode(english_text())
    rng = random.Random(seed)
    windows = []
    for length in lengths:
        if length > len(ids):
            raise ValueError(f"a {length}-token prompt is longer than the text ({len(ids)} tokens)")
        start = rng.randrange(len(ids) - length + 1)
        windows.append(ids[start : start + length])
    return windows


def excerpt(rng: random.Random, text: str, num_tokens: int) -> str:
    """About `num_tokens` tokens of `text` (sized by CHARS_PER_TOKEN) from a seeded offset."""
    length = round(num_tokens * CHARS_PER_TOKEN)
    start = rng.randrange(len(text) - length)
    return text[start : start + length]
