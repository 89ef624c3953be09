"""The machinery every bundled-dataset builder (``data/build_*.py``) shares.

Why it exists: a builder is run by the launcher (``data.prepare``) before every training run,
possibly by several launchers at once (two nodes on one machine), and may be interrupted. So
each builder must (1) return at once when its output is current, (2) let only one process
build while the others wait, (3) rebuild a cache written by an older ``FORMAT_VERSION``, and
(4) never leave a folder that looks complete but is not. Those rules live here once; a builder
only says how to make its samples.

Layout of a split: shards plus ``manifest.json``, written last and recording the builder's
``format_version`` and, for webdataset shards, ``shard_records`` (records per shard file), so a
reader counts every record a truncated shard lost (``veomni.data.sources``). A split is built in
a hidden sibling folder and renamed into place.
"""

from __future__ import annotations

import argparse
import fcntl
import importlib.util
import json
import os
import shutil
import sys
import tarfile
import time
from collections import Counter
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

from webdataset.tariterators import base_plus_ext

MANIFEST = "manifest.json"


def is_complete(out: Path, format_version: int) -> bool:
    """A split is complete once its manifest (written last) exists and has ``format_version``;
    a cache of another version counts as missing, so it is rebuilt."""
    try:
        return json.loads((out / MANIFEST).read_text()).get("format_version") == format_version
    except (OSError, ValueError):
        return False


def clear_stale(out: Path) -> None:
    """Remove an old output folder, but only if it holds nothing a builder would not write
    (shards and the manifest): a mistyped ``--train-out`` must not delete someone's files."""
    if not out.exists():
        return
    foreign = [p.name for p in out.iterdir() if p.suffix != ".tar" and p.name != MANIFEST]
    if foreign:
        sys.exit(f"{out} holds files this script did not write ({foreign[:3]}); remove it first")
    shutil.rmtree(out)


def staging_folder(out: Path) -> Path:
    """A fresh, empty hidden sibling of ``out`` to write a split into (per process, so two
    builders never share one)."""
    tmp = out.with_name(f".{out.name}.tmp-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    return tmp


def shard_record_counts(folder: Path) -> dict[str, int]:
    """Records (distinct sample keys, as webdataset groups members) of each webdataset shard
    (``*.tar``) of ``folder``, by file name."""
    counts = {}
    for shard in sorted(folder.glob("*.tar")):
        with tarfile.open(shard) as tar:
            keys = (base_plus_ext(member.name)[0] for member in tar.getmembers() if member.isfile())
            counts[shard.name] = len({key for key in keys if key is not None})
    return counts


def publish_split(tmp: Path, out: Path, manifest: dict[str, Any]) -> None:
    """Write the manifest into the staged split ``tmp`` last, with the records of each of its
    tar shards (``shard_records``, when it has any), then rename it to ``out`` (replacing an old
    ``out``): readers see either the old split or the whole new one."""
    counts = shard_record_counts(tmp)
    manifest = {**manifest, "shard_records": counts} if counts else manifest
    (tmp / MANIFEST).write_text(json.dumps(manifest, indent=2) + "\n")
    clear_stale(out)
    tmp.rename(out)


def add_to_manifest(out: Path, **fields: Any) -> None:
    """Add ``fields`` to a published split's manifest, atomically (temp file, then replace)."""
    manifest = json.loads((out / MANIFEST).read_text())
    manifest.update(fields)
    tmp = out / f".{MANIFEST}.tmp"
    tmp.write_text(json.dumps(manifest, indent=2) + "\n")
    tmp.replace(out / MANIFEST)


def majority_baseline(train: dict[str, Counter], held_out: dict[str, Counter]) -> dict[str, tuple[str, float]]:
    """Per group (question type, sound kind): the most common training answer and the held-out
    accuracy of always giving it. A model must beat this to show it reads its input."""
    result = {}
    for group, counts in train.items():
        answer = counts.most_common(1)[0][0]
        total = sum(held_out[group].values())
        result[group] = (answer, held_out[group][answer] / total if total else 0.0)
    return result


def record_baseline(eval_out: Path, baseline: dict[str, tuple[str, float]], answer_name: str, title: str) -> None:
    """Store ``baseline`` in the eval manifest (as ``{group: {answer_name: ..., "accuracy": ...}}``)
    and print it under ``title``."""
    add_to_manifest(eval_out, majority_baseline={
        group: {answer_name: answer, "accuracy": accuracy} for group, (answer, accuracy) in baseline.items()
    })
    group_width = max(len(group) for group in baseline)
    answer_width = max(len(repr(answer)) for answer, _ in baseline.values())
    print(title)
    for group, (answer, accuracy) in baseline.items():
        print(f"  {group:<{group_width}} always {answer!r:<{answer_width}} {accuracy:6.1%}")


def write_answered_split(out: Path, records: Iterable[tuple[dict[str, Any], str, str]], groups: Iterable[str],
                         samples_per_shard: int, manifest: dict[str, Any]) -> dict[str, Counter]:
    """Write a generated QA split, staged then published: ``records`` yields (webdataset record, its
    group, its answer). The manifest gets ``samples`` and the answer counts per group (``answers``)
    around ``manifest``'s own fields; returns those counts."""
    import webdataset  # here, not at the top: a cached run needs no writer

    tmp = staging_folder(out)
    answers: dict[str, Counter] = {group: Counter() for group in groups}
    count = 0
    with webdataset.ShardWriter(str(tmp / "shard-%06d.tar"), maxcount=samples_per_shard, verbose=0) as writer:
        for record, group, answer in records:
            writer.write(record)
            answers[group][answer] += 1
            count += 1
    publish_split(tmp, out, {"samples": count, **manifest,
                             "answers": {g: dict(sorted(c.items())) for g, c in answers.items()}})
    return answers


def write_generated_splits(train_out: Path, eval_out: Path, train_samples: int, eval_samples: int,
                           write_split: Callable[[Path, int, int], dict[str, Counter]],
                           unit: str = "samples") -> tuple[dict[str, Counter], dict[str, Counter]]:
    """For generated sets: ``write_split(out, first_index, count)`` writes eval as samples
    ``0 .. eval_samples - 1`` and train as the following ones, so the splits never share a
    sample. Returns the (train, held-out) answer counts per group."""
    start = time.perf_counter()
    held_out = write_split(eval_out, 0, eval_samples)
    train = write_split(train_out, eval_samples, train_samples)
    print(f"{train_out}: {train_samples} {unit}; {eval_out}: {eval_samples} {unit} "
          f"({time.perf_counter() - start:.1f}s)")
    return train, held_out


def build_once(train_out: Path, eval_out: Path, format_version: int, build: Callable[[], None]) -> None:
    """Run ``build`` unless both splits are complete. Several launchers may prepare at once:
    one builds under a file lock, the others wait for it and then find the cache complete."""
    def cached() -> bool:
        done = is_complete(train_out, format_version) and is_complete(eval_out, format_version)
        if done:
            print(f"cached: {train_out} and {eval_out} are complete")
        return done

    if cached():
        return
    train_out.parent.mkdir(parents=True, exist_ok=True)
    with open(train_out.parent / ".build.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not cached():
            build()


def load_script(path: str | Path) -> Any:
    """A script (a builder under ``data/``, a tool under ``scripts/``: not a package) loaded as a module
    named by its file's stem, and registered under that name in ``sys.modules`` (dataclasses look their
    module up there). Each call runs the script afresh."""
    path = Path(path)
    spec = importlib.util.spec_from_file_location(path.stem, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[path.stem] = module
    spec.loader.exec_module(module)
    return module


def sibling_builder(caller: str, name: str) -> Any:
    """The builder script ``name`` (e.g. ``"build_vqa"``) beside ``caller`` (a builder's ``__file__``),
    loaded as a module: some builders share another's generator (pictures, prompts, tokenizer)."""
    return load_script(Path(caller).with_name(f"{name}.py"))


def builder_main(doc: str, format_version: int, build: Callable[..., None],
                 sample_counts: tuple[int, int] | None = None, argv: list[str] | None = None) -> None:
    """The command line every builder has, as ``data.prepare`` calls it: ``--train-out``,
    ``--eval-out``, ``--seed`` (and ``--train-samples``/``--eval-samples`` with the defaults
    ``sample_counts``, for generated sets); then, once (:func:`build_once`), ``build`` with
    those options as keywords (``train_out=..., eval_out=..., seed=...``)."""
    parser = argparse.ArgumentParser(description=doc.split("\n\n")[0])
    parser.add_argument("--train-out", required=True, type=Path)
    parser.add_argument("--eval-out", required=True, type=Path)
    parser.add_argument("--seed", type=int, default=1234)
    if sample_counts is not None:
        parser.add_argument("--train-samples", type=int, default=sample_counts[0])
        parser.add_argument("--eval-samples", type=int, default=sample_counts[1])
    args = parser.parse_args(argv)
    build_once(args.train_out, args.eval_out, format_version, lambda: build(**vars(args)))
