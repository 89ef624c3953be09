"""Weighted multi-source mixtures: which sources a run reads, and which one each next sample comes from.

A run reads ``data.train_path`` (one source) or ``data.sources`` (several, each with a weight).
Sources are mixed per sample by a deterministic rule rather than by random draws: the next sample
comes from the source furthest below its share of the samples drawn so far. The realised mixture
of any prefix is then within one sample of the weights (random draws of 1,000 samples at 0.7/0.3
have a binomial standard deviation of 1.4%, and stray by more than 2% one time in six), the rule
needs no random state, and its state is one count per source. Counts restart when the weights
change at a resume, so new weights take effect from the next sample instead of first paying back
the old mixture.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from veomni.config.schema import DataConfig
from veomni.data.shards import Piece, ShardFiles
from veomni.data.sources import manifest_shard_records, resolve_files
from veomni.errors import BadConfig, MissingInput


@dataclass(frozen=True)
class SourceSpec:
    """One source with every default filled in."""

    name: str
    path: str
    weight: float
    format: str
    text_key: str


def run_sources(cfg: DataConfig, split: str) -> list[SourceSpec]:
    """The sources a split reads: ``data.sources`` or ``data.train_path`` for training, ``data.eval_path``
    for eval. Raises ``ValueError`` naming the source for a bad weight set or a repeated name."""
    if split == "eval" or not cfg.sources:
        path = cfg.train_path if split == "train" else cfg.eval_path
        return [SourceSpec(split, path or "", 1.0, cfg.format, cfg.text_key)]
    if cfg.train_path:
        raise BadConfig("data.train_path and data.sources are both set: list the train_path folder as one of "
                        "data.sources (with a weight), or remove data.sources")
    specs = []
    for index, source in enumerate(cfg.sources):
        name = source.name or Path(source.path).name.removesuffix(".jsonl") or f"source{index}"
        if source.weight < 0:
            raise BadConfig(f"data.sources[{index}] ({name!r}): weight {source.weight} is negative; weights are "
                            "shares of the samples, >= 0")
        specs.append(SourceSpec(name, source.path, source.weight, source.format or cfg.format,
                                source.text_key or cfg.text_key))
    names = [s.name for s in specs]
    repeated = sorted({n for n in names if names.count(n) > 1})
    if repeated:
        raise BadConfig(f"data.sources: the name(s) {repeated} are used twice; give each source its own name")
    if sum(s.weight for s in specs) <= 0:
        raise BadConfig(f"data.sources: the weights of {names} sum to zero; at least one source needs weight > 0")
    return specs


def source_files(spec: SourceSpec, split: str) -> ShardFiles:
    """The source's files (with the manifest's records per shard, if any), or ``FileNotFoundError``
    naming the source and its path."""
    try:
        fmt, files = resolve_files(spec.path, spec.format)
    except FileNotFoundError as exc:
        key = f"data.{split}_path" if spec.name == split else f"data.sources ({spec.name!r})"
        raise MissingInput(f"{key}: {exc}") from None
    return ShardFiles(files, fmt, manifest_shard_records(spec.path))


def check_sources(cfg: DataConfig) -> list[str]:
    """Launch-time problems of the training sources: a bad weight set, a path that does not exist or
    holds no data files, a source whose files hold no record at all (one record read per source)."""
    try:
        specs = run_sources(cfg, "train")
    except ValueError as exc:
        return [str(exc)]
    problems = []
    for spec in specs:
        try:
            files = source_files(spec, "train")
        except FileNotFoundError as exc:
            problems.append(str(exc))
            continue
        if not any(_first_record(files, index) for index in range(len(files.files))):
            where = "data.train_path" if spec.name == "train" else f"data.sources ({spec.name!r})"
            problems.append(f"{where}: {spec.path} holds no record in its {len(files.files)} {files.fmt} file(s)")
    return problems


def _first_record(files: ShardFiles, index: int) -> bool:
    try:
        return next(files.records(Piece(index, 0, files.sizes[index])), None) is not None
    except Exception:  # noqa: BLE001 - a damaged file may still be followed by good ones
        return False


def next_source(weights: Sequence[float], counts: Sequence[int]) -> int:
    """The source the next sample comes from: the one whose count is furthest below its share of the
    samples drawn so far (``weight x (drawn + 1) - count`` largest; ties go to the first listed).
    Weight-0 sources are never drawn."""
    total = sum(weights)
    drawn = sum(counts)
    best, best_gap = -1, 0.0
    for index, (weight, count) in enumerate(zip(weights, counts)):
        if weight <= 0:
            continue
        gap = weight / total * (drawn + 1) - count
        if best < 0 or gap > best_gap:
            best, best_gap = index, gap
    return best
