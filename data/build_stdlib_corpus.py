"""Build an offline text corpus from the running Python's standard library.

Why this corpus: it is real, varied text (code plus prose) that every machine already has, so
training and tests need no download. Documents are the stdlib ``.py`` sources (no tests, no
site-packages, nothing over 200 kB) and the ``pydoc_data`` documentation topics.

Documents are then cut at blank lines into pieces of about ``PIECE_CHARS`` characters and the
pieces shuffled: a stdlib file averages ~4k tokens, so without this a micro-batch would hold one
or two files and the per-step loss would swing with whichever file it was. The eval split holds
out whole files (~5%) before cutting, so no eval text is seen in training. Why 5% and not less:
the end-of-run summary's baseline is the eval tokens' own unigram entropy, and on a small held-out
set that is far below what a context-free model can reach (44 pieces, ~40k tokens, gave 6.04 nats
where the training split's own entropy is 6.71): a model that learned plenty then looks barely
better than its baseline.

Output: webdataset tar shards (~8 MB each, samples ``{"__key__", "txt"}``) in ``--train-out``
and ``--eval-out``, each with a ``manifest.json`` written last (it records ``FORMAT_VERSION``;
a cache of another version is rebuilt).
Each split is written to a temporary sibling folder and renamed into place, so an interrupted
run never leaves a folder that looks complete. When both manifests exist the script says
"cached" and exits.

    python data/build_stdlib_corpus.py --train-out data/cache/stdlib/train --eval-out data/cache/stdlib/eval
"""

from __future__ import annotations

import functools
import os
import random
import re
import sys
import sysconfig
import time
from collections.abc import Callable
from pathlib import Path

from veomni.data.builders import builder_main, publish_split, staging_folder

SKIP_DIRS = {"site-packages", "test", "tests", "idle_test", "__pycache__"}
MAX_FILE_BYTES = 200_000
SHARD_BYTES = 8_000_000
EVAL_FRACTION = 0.05
PIECE_CHARS = 2000
FORMAT_VERSION = 5  # 4: shard_records (records per shard; publish_split writes it); 5: 5% of files held out


def stdlib_documents() -> list[tuple[str, str]]:
    """(name, text) for every stdlib source file and pydoc topic, in a stable order."""
    root = Path(sysconfig.get_paths()["stdlib"])
    docs: list[tuple[str, str]] = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = sorted(d for d in dirnames if d not in SKIP_DIRS)
        for filename in sorted(filenames):
            path = Path(dirpath) / filename
            if path.suffix != ".py" or path.stat().st_size > MAX_FILE_BYTES:
                continue
            try:
                text = path.read_text(encoding="utf-8")
            except (UnicodeDecodeError, OSError):
                continue
            if text.strip():
                docs.append(("stdlib/" + path.relative_to(root).as_posix(), text))
    from pydoc_data.topics import topics

    docs.extend((f"topic/{name}", text) for name, text in sorted(topics.items()) if text.strip())
    return docs


def split_into_pieces(name: str, text: str, target: int = PIECE_CHARS) -> list[tuple[str, str]]:
    """Cut at blank lines into pieces of at least ``target`` characters (the last may be shorter);
    a paragraph is never split, so code blocks and sentences stay whole."""
    pieces, current = [], []
    size = 0
    for paragraph in re.split(r"\n\s*\n", text):
        current.append(paragraph)
        size += len(paragraph) + 2
        if size >= target:
            pieces.append("\n\n".join(current))
            current, size = [], 0
    if current and "\n\n".join(current).strip():
        pieces.append("\n\n".join(current))
    return [(f"{name}#{i}", piece) for i, piece in enumerate(pieces)]


def sample_key(index: int, name: str) -> str:
    """A webdataset key: unique, and free of dots (webdataset splits key and suffix at the first dot)."""
    return f"{index:06d}_" + re.sub(r"[^A-Za-z0-9_-]", "_", name)


def write_split(docs: list[tuple[str, str]], out: Path, first_index: int) -> dict:
    """Write one split into a temp folder, add the manifest, then rename it to ``out``."""
    import webdataset  # here, not at the top: it imports torch, and a cached run needs neither (1.5 s)

    tmp = staging_folder(out)
    total_bytes = 0
    with webdataset.ShardWriter(str(tmp / "shard-%06d.tar"), maxsize=SHARD_BYTES, verbose=0) as writer:
        for offset, (name, text) in enumerate(docs):
            writer.write({"__key__": sample_key(first_index + offset, name), "txt": text})
            total_bytes += len(text.encode("utf-8"))
            if (offset + 1) % 2000 == 0:
                print(f"  {out.name}: {offset + 1} documents, {total_bytes / 1e6:.1f} MB", flush=True)
    shards = len(list(tmp.glob("*.tar")))
    manifest = {
        "documents": len(docs),
        "bytes": total_bytes,
        "shards": shards,
        "python": sys.version.split()[0],
        "format_version": FORMAT_VERSION,
        "source": "python stdlib .py files + pydoc_data topics",
    }
    publish_split(tmp, out, manifest)
    print(f"{out}: {len(docs)} documents, {total_bytes / 1e6:.1f} MB in {shards} shard(s)", flush=True)
    return manifest


def pieces(files: list[tuple[str, str]]) -> list[tuple[str, str]]:
    """The default documents: every file cut into ~2 KB pieces."""
    return [piece for name, text in files for piece in split_into_pieces(name, text)]


def main(documents: Callable[[list[tuple[str, str]]], list[tuple[str, str]]] = pieces) -> None:
    """Build (once) the splits, with ``documents`` turning held-out/train files into documents."""
    builder_main(__doc__, FORMAT_VERSION, functools.partial(build, documents=documents))


def build(train_out: Path, eval_out: Path, seed: int,
          documents: Callable[[list[tuple[str, str]]], list[tuple[str, str]]]) -> None:
    start = time.perf_counter()
    docs = stdlib_documents()
    rng = random.Random(seed)
    rng.shuffle(docs)
    n_eval = max(1, round(EVAL_FRACTION * len(docs)))
    print(
        f"{len(docs)} files from Python {sys.version.split()[0]}; {n_eval} held out for eval", flush=True
    )
    # Exact duplicates (the stdlib repeats some text across files) are dropped, so no eval
    # piece is also a train piece.
    seen: set[str] = set()
    splits = {}
    for split, files in (("eval", docs[:n_eval]), ("train", docs[n_eval:])):
        unique = []
        for doc_name, text in documents(files):
            if text not in seen:
                seen.add(text)
                unique.append((doc_name, text))
        rng.shuffle(unique)
        splits[split] = unique
    write_split(splits["train"], train_out, first_index=len(splits["eval"]))
    write_split(splits["eval"], eval_out, first_index=0)
    print(f"done in {time.perf_counter() - start:.1f}s")


if __name__ == "__main__":
    main()
