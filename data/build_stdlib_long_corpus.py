"""Long documents for long-context recipes: each stdlib package's modules concatenated.

The default corpus cuts files into ~2 KB pieces, which is right for short-context training;
long-context training needs samples of tens of thousands of tokens. Here every package
(``email``, ``asyncio``, ...) becomes one document of its modules, each preceded by a
``# file:`` header (repository-level concatenation, as code LMs train on), capped at
``MAX_CHARS``; top-level modules are grouped the same way in name order. Same splits,
caching, locking and manifest as ``build_stdlib_corpus.py``.

    python data/build_stdlib_long_corpus.py --train-out data/cache/stdlib_long/train \
        --eval-out data/cache/stdlib_long/eval
"""

from __future__ import annotations

import itertools
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import build_stdlib_corpus  # noqa: E402

MAX_CHARS = 400_000  # ~100k tokens: longer than any recipe's sequence


def _group(name: str) -> str:
    parts = name.split("/")
    return parts[1] if parts[0] == "stdlib" and len(parts) > 2 else parts[0]


def packages(files: list[tuple[str, str]]) -> list[tuple[str, str]]:
    docs = []
    ordered = sorted(files, key=lambda f: (_group(f[0]), f[0]))
    for group, members in itertools.groupby(ordered, key=lambda f: _group(f[0])):
        text, part = "", 0
        for name, body in members:
            block = f"# file: {name}\n{body}\n\n"
            if text and len(text) + len(block) > MAX_CHARS:
                docs.append((f"{group}#{part}", text))
                text, part = "", part + 1
            text += block
        if text:
            docs.append((f"{group}#{part}", text))
    return docs


if __name__ == "__main__":
    build_stdlib_corpus.main(documents=packages)
