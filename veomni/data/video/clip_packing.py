"""NaViT patch n' pack for latent images and clips: rows of whole samples under a patch budget.

Why no resolution buckets: a bucket batch holds samples of one shape, so each step sees one
resolution and a row holds ``budget // cost`` samples with the remainder padded (or, batching
mixed shapes, every sample padded to the longest). Packing puts samples of any shape into one row
of patch tokens (``veomni.ops.video_patch`` layout) with per-sample boundaries (``cu_seqlens``):
attention never crosses samples and no compute goes to padding.

A row is filled by **greedy best fit over a lookahead buffer**: the buffer holds the next
samples of the stream, at least ``lookahead`` rows' worth of patches (while the stream lasts);
a row starts with the oldest buffered sample (so no sample waits more than a few rows, and
stream order is roughly kept) and then repeatedly takes the largest buffered sample that still
fits, until none does. Small samples (images) fill the gaps large ones (clips) leave, so a row's
unused budget is small: ``scripts/bench_video_packing.py`` measures it against buckets.

Everything here is pure (no I/O); the ``video_latents`` dataset kind (``veomni.data.video.latents``)
reads the shards and keeps the resume position.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from itertools import accumulate
from typing import Any, TypeVar

import torch

from veomni.errors import BadData
from veomni.ops.video_patch import grid_positions, patch_grid, patchify

Item = TypeVar("Item")

LOOKAHEAD_ROWS = 8
"""Rows' worth of patches the packer looks ahead over. ``scripts/bench_video_packing.py``, Wan-VAE
mix of images and clips: 16% of the budget wasted at 1 row, 2.0% at 4, 1.1% at 8, 1.0% at 16."""


@dataclass
class LatentSample:
    """One decoded sample of a latent shard."""

    key: str
    latent: torch.Tensor
    """float32 [C, F, H, W], already normalised by the VAE's shift and scaling."""
    text: torch.Tensor
    """float32 [L, text_dim]: the text encoder's states of the caption's real tokens."""
    meta: dict[str, Any] = field(default_factory=dict)
    """The sample's json (``caption``, ``latent_shape``, ...)."""
    condition: torch.Tensor | None = None
    """float32 [Q, F, H, W]: image-to-video conditioning channels (``veomni.data.video.conditioning``)."""
    image: torch.Tensor | None = None
    """float32 [L, image_dim]: the image encoder's states of the first frame."""

    @property
    def caption(self) -> str:
        return str(self.meta.get("caption", ""))


def patch_count(shape: Sequence[int], patch: tuple[int, int, int]) -> int:
    """Patch tokens of a latent of ``shape = [C, F, H, W]`` (ValueError when the patch does not divide it)."""
    return math.prod(patch_grid(tuple(shape), patch))


def check_fits(key: str, shape: Sequence[int], tokens: int, budget: int) -> None:
    """ValueError naming the sample when its ``tokens`` exceed the row budget."""
    if tokens > budget:
        raise BadData(f"sample {key!r} with latent shape {list(shape)} (C, F, H, W) is {tokens} patches, more "
                      f"than data.tokens_per_micro_batch={budget}: raise the budget to at least {tokens}, or "
                      "crop or shorten such samples")


def best_fit_rows(samples: Iterable[Item], budget: int, cost: Callable[[Item], int],
                  lookahead: int = LOOKAHEAD_ROWS, buffered: Sequence[Item] = ()
                  ) -> Iterator[tuple[list[Item], list[Item]]]:
    """Pack ``samples`` into rows of at most ``budget`` (module docstring); yields
    ``(row, still buffered)`` after each row, the buffer in stream order. Every sample lands in
    exactly one row; the last rows empty the buffer. A resumed reader passes the buffer it had
    after its last row as ``buffered`` and the rest of the stream as ``samples``: the rows are
    those the uninterrupted packer makes. ``cost(sample)`` must be in ``1..budget`` (callers
    check it first to name the sample)."""
    if budget < 1 or lookahead < 1:
        raise ValueError(f"budget ({budget}) and lookahead ({lookahead}) must be >= 1")
    stream = iter(samples)
    buffer: list[tuple[Item, int]] = []
    total = 0
    exhausted = False
    pending = iter(buffered)
    while True:
        for sample in pending:
            buffer.append((sample, _checked_cost(sample, cost, budget)))
            total += buffer[-1][1]
        while not exhausted and total < lookahead * budget:
            sample = next(stream, _END)
            if sample is _END:
                exhausted = True
                break
            buffer.append((sample, _checked_cost(sample, cost, budget)))
            total += buffer[-1][1]
        if not buffer:
            return
        row = _fill_row(buffer, budget)
        total -= sum(size for _, size in row)
        yield [sample for sample, _ in row], [sample for sample, _ in buffer]


_END = object()


def _checked_cost(sample: Any, cost: Callable[[Any], int], budget: int) -> int:
    size = cost(sample)
    if not 0 < size <= budget:
        raise ValueError(f"a sample of {size} patches cannot be packed into a budget of {budget}")
    return size


def _fill_row(buffer: list[tuple[Any, int]], budget: int) -> list[tuple[Any, int]]:
    """Take one row out of ``buffer`` (in place): its oldest sample, then the largest that fits
    until none does (the earliest among equals)."""
    row = [buffer.pop(0)]
    space = budget - row[0][1]
    while True:
        best, best_size = -1, 0
        for index, (_, size) in enumerate(buffer):
            if best_size < size <= space:
                best, best_size = index, size
                if size == space:
                    break
        if best < 0:
            return row
        row.append(buffer.pop(best))
        space -= best_size


def pack_row(samples: Sequence[LatentSample], patch: tuple[int, int, int]) -> dict[str, Any]:
    """The batch dict of one packed row (the contract in ``veomni/tasks/flow.py``)."""
    if not samples:
        raise ValueError("a packed row needs at least one sample")
    grids = [patch_grid(tuple(s.latent.shape), patch) for s in samples]
    lengths = [math.prod(g) for g in grids]
    text_lengths = [s.text.shape[0] for s in samples]
    conditioning = {}
    if samples[0].condition is not None:
        conditioning["condition"] = torch.cat([patchify(s.condition.float(), patch) for s in samples])
    if samples[0].image is not None:
        conditioning["image_states"] = torch.cat([s.image.float() for s in samples])
        conditioning["image_cu_seqlens"] = torch.tensor([0, *accumulate(len(s.image) for s in samples)],
                                                        dtype=torch.int32)
    return {
        **conditioning,
        "latents": torch.cat([patchify(s.latent.float(), patch) for s in samples]),
        "positions": torch.cat([grid_positions(g) for g in grids]),
        "sample_index": torch.repeat_interleave(torch.arange(len(samples)), torch.tensor(lengths)),
        "cu_seqlens": torch.tensor([0, *accumulate(lengths)], dtype=torch.int32),
        "max_seqlen": max(lengths),
        "grid": torch.tensor(grids, dtype=torch.int64),
        "text_states": torch.cat([s.text.float() for s in samples]),
        "text_cu_seqlens": torch.tensor([0, *accumulate(text_lengths)], dtype=torch.int32),
        "captions": [s.caption for s in samples],
    }


@dataclass(frozen=True)
class Waste:
    """How well a scheme's rows use the patch budget."""

    real: int
    """Sample patches in the rows."""
    padding: int
    """Padding patches the rows compute (0 for packing)."""
    rows: int
    budget: int

    @property
    def fraction(self) -> float:
        """``1 - real / (rows x budget)``: the share of the rows' budget that holds no sample patch,
        whether it is computed as padding or left unused (a shorter row: less work per step)."""
        return 1.0 - self.real / (self.rows * self.budget) if self.rows else 0.0


def packing_waste(costs: Sequence[int], budget: int, lookahead: int = LOOKAHEAD_ROWS,
                  drop_last: bool = True) -> Waste:
    """Our packing (``best_fit_rows``) of a stream of per-sample patch counts; rows are not
    padded. ``drop_last`` leaves out the stream's last row, which only the end of a pass leaves
    part-filled (every scheme has such a tail)."""
    rows = [sum(row) for row, _ in best_fit_rows(costs, budget, int, lookahead)]
    if drop_last and len(rows) > 1:
        rows = rows[:-1]
    return Waste(sum(rows), 0, len(rows), budget)


def bucket_waste(costs: Sequence[int], budget: int, drop_last: bool = True) -> Waste:
    """Resolution buckets padded to the budget: samples of one patch count (one latent shape, for
    a given patch size) form a bucket; each row holds ``budget // cost`` samples of one bucket and
    is padded to ``budget`` (a fixed micro-batch shape). ``drop_last`` leaves out each bucket's
    part-filled last row (as a bucket sampler that drops incomplete batches does)."""
    real = rows = 0
    for cost, count in sorted(Counter(costs).items()):
        per_row = budget // cost
        full, rest = divmod(count, per_row)
        rows += full + (0 if drop_last or not rest else 1)
        real += cost * (full * per_row + (0 if drop_last else rest))
    return Waste(real, rows * budget - real, rows, budget)


def padded_batch_waste(costs: Sequence[int], budget: int, drop_last: bool = True) -> Waste:
    """No buckets, a fixed batch size, padding to the longest: consecutive samples of the stream
    form batches of ``budget // max(costs)`` samples (the most that fit when any sample may be the
    longest); a batch computes ``batch size x its longest sample`` patches, the rest of the budget
    stays unused. ``drop_last`` leaves out the last, shorter batch."""
    size = budget // max(costs)
    batches = [costs[i:i + size] for i in range(0, len(costs), size)]
    if drop_last and len(batches) > 1 and len(batches[-1]) < size:
        batches = batches[:-1]
    real = sum(sum(b) for b in batches)
    return Waste(real, sum(size * max(b) for b in batches) - real, len(batches), budget)
