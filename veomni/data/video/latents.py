"""The ``video_latents`` dataset kind: precomputed latent images and clips, packed NaViT style.

A split is a builder-standard folder (``veomni.data.builders``) of webdataset shards whose
samples hold ``latent.safetensors`` (``{"latent": float32 [C, F, H, W], "text": float32
[L, text_dim]}``) and ``json`` (the clip's fields plus ``latent_shape``), and a ``manifest.json``
with ``latent_channels``, ``text_dim``, ``shapes`` {"CxFxHxW": count} and ``example_keys``.
Rows are packed by ``veomni.data.video.clip_packing`` (best fit under ``data.tokens_per_micro_batch``
patches) into the batch of ``veomni/tasks/flow.py``.

**Launch check** (``check_video_latents``): the manifest alone (no shard is opened) against the
model: every shape divisible by the patch size, its channels and text width, and the largest
sample within the budget, so a wrong recipe fails before any worker starts.

**Who reads what.** Every data-parallel rank x loader worker is a consumer (``consumer()``). With
at least as many shards as consumers, consumer ``c`` of ``C`` reads shards ``c, c + C, ...`` of
the epoch's shard order (each reads only its own files); with fewer shards (a small eval split),
every consumer reads them all and keeps records ``i`` with ``i % C == c``. Train shuffles the shard
order and each shard's records (a shard is held in memory while it is read) from
``(seed, epoch)``, loops over epochs, and empties the packer's buffer at an epoch's end; eval is
one pass in file order.

**Corrupt samples** (bytes that are not safetensors, missing tensors, a shape disagreeing with
the json, channels or text width not the model's) are skipped, logged and counted with the
damaged shards in the pass's ``ReadStats``; above ``data.max_bad_fraction`` the run stops
(``veomni.data.sources``). A sample that decodes but does not fit (over the budget, not divisible
by the patch) was announced wrongly by the manifest, which the launch check trusts: it stops the
run, naming the sample.

**Resume is exact**: a position is the epoch, the stream index of the first record not yet read,
and the indices of the records read but still in the packer's buffer. A resumed reader reads the
epoch's stream again up to that index, decoding (so the bad counts are those of the uninterrupted
pass) but keeping only the buffered records, and packs on from the same buffer: the next rows are
the same. At another layout (``merge_positions``) every consumer restarts at the earliest epoch any
old consumer was in. The protocol around the position is ``ResumableDataset``'s (``veomni/data/resume.py``).
"""

from __future__ import annotations

import itertools
import json
import logging
import random
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from safetensors.torch import load as load_safetensors

from veomni.config.schema import DataConfig
from veomni.data.builders import MANIFEST
from veomni.data.kinds import DatasetKind, DatasetRequest, ResumableDataset, register_dataset
from veomni.data.resume import every_consumer
from veomni.data.sources import ReadStats, count_bad, iter_records, manifest_shard_records, resolve_files, tar_samples
from veomni.data.video.clip_packing import LatentSample, best_fit_rows, check_fits, pack_row, patch_count
from veomni.data.video.conditioning import (
    NO_CONDITIONING,
    Conditioning,
    conditioning_problems,
    decode_conditioning,
)
from veomni.errors import BadConfig, BadData

logger = logging.getLogger(__name__)

STATE_FORMAT = "veomni.video_latents.v1"
LATENT_MEMBER = "latent.safetensors"
MODEL_FIELDS = ("patch_size", "in_channels", "out_channels", "text_dim", "image_dim")


@dataclass(frozen=True)
class Position:
    """Where a consumer resumes (module docstring); the counters are for reporting."""

    epoch: int = 0
    next_record: int = 0
    pending: tuple[int, ...] = ()
    records_prior_epochs: int = 0
    bad_prior_epochs: int = 0


@dataclass
class _Cursor:
    """What the reader of one epoch has read so far (the packer pulls from it lazily)."""

    next_record: int = 0
    done: bool = False
    stats: ReadStats = field(default_factory=ReadStats)


class VideoLatentsDataset(ResumableDataset):
    """One consumer's packed rows of a latent split (the module docstring)."""

    state_format = STATE_FORMAT

    def __init__(self, request: DatasetRequest) -> None:
        super().__init__(request.dp_rank, request.dp_size, Position())
        cfg, model = request.cfg, request.model_config
        problems = model_problems(model) or self._split_problems("data path", request.path, cfg, model)
        if problems:
            raise BadConfig("; ".join(problems))
        _, self.files = resolve_files(request.path, "webdataset")
        self.shard_records = manifest_shard_records(request.path)
        """Records per shard file, from the manifest: what a damaged shard lost (``veomni.data.sources``)."""
        self.cfg, self.split, self.seed = cfg, request.split, request.seed
        self.patch = tuple(model.patch_size)
        self.channels, self.text_dim = model.out_channels, model.text_dim
        self.conditioning = Conditioning.of(model)

    @staticmethod
    def _split_problems(name: str, path: str, cfg: DataConfig, model_config: Any) -> list[str]:
        """What is wrong between a split and the model (the launch check of one split)."""
        return split_problems(name, path, cfg, model_config)

    # ----- the record stream of one epoch ----------------------------------------------------
    def _consumer_files(self, epoch: int) -> tuple[list[Path], int, int]:
        """(files this consumer reads, record stride, record offset) in ``epoch``."""
        consumer, consumers = self.consumer()
        files = list(self.files)
        if self._shuffled:
            random.Random(f"video_latents:{self.seed}:{epoch}").shuffle(files)
        if len(files) >= consumers:
            return files[consumer::consumers], 1, 0
        return files, consumers, consumer

    @property
    def _shuffled(self) -> bool:
        return self.split == "train" and self.cfg.shuffle

    def _shard_records(self, file: Path, epoch: int) -> Iterator[dict]:
        """A shard's records, shuffled in train; the good records before damage come first, then
        the damage is raised (``iter_records`` counts what the shard lost)."""
        records: list[dict] = []
        damage: Exception | None = None
        try:
            records.extend(tar_samples(file))
        except Exception as error:  # noqa: BLE001 - re-raised below, after the good records
            damage = error
        if self._shuffled:
            random.Random(f"video_latents:{self.seed}:{epoch}:{file.name}").shuffle(records)
        yield from records
        if damage is not None:
            raise damage

    def _read(self, epoch: int, start: Position, cursor: _Cursor) -> Iterator[tuple[int, LatentSample, int]]:
        """``(record index, sample, patches)`` of this consumer's good records of ``epoch``: from
        ``start.next_record`` on, plus the buffered ``start.pending`` ones before it. Every record
        read is decoded, also the other consumers' in a record-level split, so each consumer's
        bad fraction is that of the whole stream (and only consumer 0 warns about shared files);
        only this consumer's records become samples (``_to_sample``)."""
        files, stride, offset = self._consumer_files(epoch)
        consumer, _ = self.consumer()
        warn = stride == 1 or consumer == 0
        pending = set(start.pending)
        records = iter_records(files, lambda file: self._shard_records(file, epoch), self.cfg.max_bad_fraction,
                               cursor.stats, warn=warn, shard_records=self.shard_records)
        for index, record in enumerate(records):
            cursor.next_record = max(cursor.next_record, index + 1)
            sample = self._decode(record, cursor.stats, warn)
            mine = index % stride == offset and (index >= start.next_record or index in pending)
            if sample is not None and mine:
                sample = self._to_sample(sample)
                yield index, sample, self._patches(sample)
        cursor.done = True

    def _decode(self, record: dict, stats: ReadStats, warn: bool) -> Any:
        """The decoded record (``_decode_record``), or None (logged and counted as bad) when it is corrupt."""
        key, url = record.get("__key__", "?"), record.get("__url__", "?")
        try:
            return self._decode_record(record)
        except Exception as error:  # noqa: BLE001 - one corrupt sample must not stop the run
            (logger.warning if warn else logger.debug)("%s: sample %s skipped: %s: %s", url, key,
                                                       type(error).__name__, error)
            count_bad(stats, url, self.cfg.max_bad_fraction)
            return None

    def _decode_record(self, record: dict) -> Any:
        """What every record read is turned into; any error makes it a counted corrupt record."""
        return decode_sample(record, self.channels, self.text_dim, self.conditioning)

    def _to_sample(self, decoded: Any) -> LatentSample:
        """The sample of a decoded record this consumer keeps (a kind that encodes does it here);
        its errors stop the run."""
        return decoded

    def _patches(self, sample: LatentSample) -> int:
        """Its patch count; a sample the manifest did not announce (over the budget, or not
        divisible by the patch size) stops the run, naming it."""
        shape = list(sample.latent.shape)
        try:
            tokens = patch_count(shape, self.patch)
        except ValueError as error:
            raise BadData(f"sample {sample.key!r}: {error}") from None
        check_fits(sample.key, shape, tokens, self.cfg.tokens_per_micro_batch)
        return tokens

    # ----- rows, epochs and positions ----------------------------------------------------------
    def __iter__(self) -> Iterator[dict]:
        """Start at the loaded position (once), else at the beginning; eval is one pass, train loops."""
        return self._rows(self.begin())

    def _rows(self, start: Position) -> Iterator[dict]:
        records_prior, bad_prior = start.records_prior_epochs, start.bad_prior_epochs
        while self.split == "train" or start.epoch == 0:
            epoch, cursor, produced = start.epoch, _Cursor(start.next_record), False
            reader = self._read(epoch, start, cursor)
            buffered = list(itertools.islice(reader, len(start.pending)))
            if [index for index, _, _ in buffered] != list(start.pending):
                raise BadData(f"resuming epoch {epoch} of {self.files[0].parent}: the records buffered at the "
                              f"checkpoint ({list(start.pending)}) are not where they were; the split changed "
                              "since, so the position cannot be found again: start the data anew")
            rows = best_fit_rows(reader, self.cfg.tokens_per_micro_batch, cost=lambda item: item[2],
                                 buffered=buffered)
            for row, still_buffered in rows:
                produced = True
                if cursor.done and not still_buffered:
                    records_prior, bad_prior = records_prior + cursor.stats.records, bad_prior + cursor.stats.bad
                    self._pos = Position(epoch + 1, 0, (), records_prior, bad_prior)
                else:
                    self._pos = Position(epoch, cursor.next_record, tuple(i for i, _, _ in still_buffered),
                                         records_prior, bad_prior)
                yield pack_row([sample for _, sample, _ in row], self.patch)
            if self._pos.epoch == epoch:  # a resumed epoch with nothing left to pack
                records_prior, bad_prior = records_prior + cursor.stats.records, bad_prior + cursor.stats.bad
                self._pos = Position(epoch + 1, 0, (), records_prior, bad_prior)
            if not produced and start.next_record == 0 and self.split == "train":
                consumer, consumers = self.consumer()
                raise BadData(f"consumer {consumer} of {consumers} (dp ranks x data.num_workers) got no usable "
                              f"sample in a whole epoch of {self.files[0].parent}")
            start = self._pos

    def position_state(self) -> dict[str, Any]:
        return {**asdict(self._pos), "pending": list(self._pos.pending)}

    def position_from(self, state: dict[str, Any]) -> Position:
        return Position(state["epoch"], state["next_record"], tuple(state["pending"]), state["records_prior_epochs"],
                        state["bad_prior_epochs"])

    @classmethod
    def merge_positions(cls, states: list[dict[str, Any]]) -> dict[str, Any]:
        """The start of the earliest epoch any old consumer was in: which consumer read which
        shard depends on the layout, so only an epoch boundary is common to every layout; the
        part of that epoch already trained on is seen again, nothing is skipped."""
        every_consumer(states)  # refuses an incomplete or mixed set
        earliest = min(states, key=lambda s: s["epoch"])
        return asdict(Position(earliest["epoch"], 0, (), earliest["records_prior_epochs"],
                               earliest["bad_prior_epochs"]))


def decode_sample(record: dict, channels: int, text_dim: int,
                  conditioning: Conditioning = NO_CONDITIONING) -> LatentSample:
    """The sample of a shard record (with the ``conditioning`` the model reads); ValueError (or the
    decoder's error) saying what is wrong."""
    key = record.get("__key__", "?")
    for member in (LATENT_MEMBER, "json"):
        if member not in record:
            raise BadData(f"no {member!r} member")
    meta = json.loads(record["json"])
    tensors = load_safetensors(record[LATENT_MEMBER])
    latent, text = tensors.get("latent"), tensors.get("text")
    if latent is None or text is None:
        raise BadData(f"{LATENT_MEMBER} holds {sorted(tensors)}, not 'latent' and 'text'")
    if latent.dim() != 4 or list(latent.shape) != list(meta.get("latent_shape", [])):
        raise BadData(f"latent shape {list(latent.shape)} disagrees with the json's latent_shape "
                      f"{meta.get('latent_shape')}")
    if latent.shape[0] != channels:
        raise BadData(f"latent has {latent.shape[0]} channels, the model takes {channels}")
    if text.dim() != 2 or text.shape[1] != text_dim:
        raise BadData(f"text states of shape {list(text.shape)}, expected [L, {text_dim}]")
    if not (latent.is_floating_point() and text.is_floating_point()):
        raise BadData(f"latent {latent.dtype} / text {text.dtype} must be floating point")
    condition, image = decode_conditioning(tensors, latent, conditioning)
    return LatentSample(key, latent.float(), text.float(), meta, condition, image)


# ----- the launch check: the manifest against the model ---------------------------------------
def model_problems(model_config: Any, kind: str = "video_latents") -> list[str]:
    missing = [name for name in MODEL_FIELDS if not hasattr(model_config, name)]
    if missing:
        return [f"data.kind {kind} feeds models whose config has {', '.join(MODEL_FIELDS)} "
                f"(veomni.ops.video_patch.VideoModelConfig); {type(model_config).__name__} lacks "
                f"{', '.join(missing)}: pick a video model (model.arch) or another data.kind"]
    return []


def read_latent_manifest(path: str | Path) -> dict[str, Any]:
    """The split's manifest; ValueError saying what is missing."""
    file = Path(path) / MANIFEST
    try:
        manifest = json.loads(file.read_text())
    except (OSError, ValueError) as error:
        raise BadData(f"{file} cannot be read ({error}); the video_latents kind needs the manifest a latent "
                      "builder writes (data/build_video_latents.py)") from None
    missing = [k for k in ("latent_channels", "text_dim", "shapes", "example_keys") if k not in manifest]
    if missing:
        raise BadData(f"{file} lacks {missing}; rebuild the split with data/build_video_latents.py")
    return manifest


def split_problems(name: str, path: str, cfg: DataConfig, model_config: Any) -> list[str]:
    """What is wrong between one split's manifest and the model and budget (``name``: how to call it)."""
    if cfg.format == "jsonl":
        return ["data.format jsonl: the video_latents kind reads webdataset shards; set data.format: webdataset"]
    try:
        manifest = read_latent_manifest(path)
    except ValueError as error:
        return [f"{name}: {error}"]
    examples = {shape: f"sample {manifest['example_keys'].get(shape, '?')!r}" for shape in manifest["shapes"]}
    example = next(iter(examples.values()), "no sample")
    return (latent_problems(name, path, manifest["latent_channels"], manifest["text_dim"], examples, cfg, model_config)
            + conditioning_problems(name, path, manifest, example, model_config))


def latent_problems(name: str, source: str, channels: int, text_dim: int, examples: dict[str, str],
                    cfg: DataConfig, model_config: Any) -> list[str]:
    """The latents' channels and text width against the model, every latent shape (``examples``:
    ``"CxFxHxW"`` -> which sample shows it, e.g. ``"sample 'k'"``) against the patch size, and the
    largest against the budget; ``source`` says where the latents come from."""
    patch, budget = tuple(model_config.patch_size), cfg.tokens_per_micro_batch
    problems = []
    if channels != model_config.out_channels:  # the conditioning channels are conditioning_problems'
        field = "in_channels" if model_config.in_channels == model_config.out_channels else "out_channels"
        problems.append(f"{name}: latents of {source} have {channels} channels, model.{field}="
                        f"{getattr(model_config, field)}; set model.{field}: {channels}")
    if text_dim != model_config.text_dim:
        problems.append(f"{name}: text states of {source} are {text_dim} wide, model.text_dim={model_config.text_dim}; "
                        f"set model.text_dim: {text_dim}")
    largest = None
    for text, example in examples.items():
        shape = [int(size) for size in text.split("x")]
        try:
            tokens = patch_count(shape, patch)
        except ValueError as error:
            problems.append(f"{name}: {example} of {source}: {error}")
            continue
        if largest is None or tokens > largest[0]:
            largest = (tokens, shape, example)
    if largest is not None and largest[0] > budget:
        tokens, shape, example = largest
        problems.append(f"{name}: the largest latent of {source}, shape {shape} (e.g. {example}), is "
                        f"{tokens} patches of {list(patch)}, more than data.tokens_per_micro_batch={budget}; "
                        f"raise it to at least {tokens}")
    return problems


def check_video_latents(cfg: DataConfig, model_config: Any) -> list[str]:
    """The launcher's pre-flight: each split's manifest (no shard is read) against the model.
    A split that does not exist yet is the launcher's own message (``data.prepare``)."""
    return model_problems(model_config) or each_split_problems(cfg, model_config, split_problems)


def each_split_problems(cfg: DataConfig, model_config: Any,
                        problems_of: Callable[[str, str, DataConfig, Any], list[str]]) -> list[str]:
    """``problems_of(name, path, cfg, model_config)`` of each split that exists (eval once when it is train)."""
    problems = []
    for name, path in (("data.train_path", cfg.train_path), ("data.eval_path", cfg.eval_path)):
        if path and Path(path).exists() and not (name == "data.eval_path" and path == cfg.train_path):
            problems += problems_of(name, path, cfg, model_config)
    return problems


register_dataset(DatasetKind("video_latents", VideoLatentsDataset, check=check_video_latents))
