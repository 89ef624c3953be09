"""Long-short sequence parallelism for media encoders: one long item over a group of ranks.

A high-resolution image or a long audio clip can cost an encoder more than all the other items
of a step together; balancing whole items (``colocate.py``) cannot split it. An item whose
encoder sequence (``ShardableEncoder.sequence_rows``: a ViT's patches, an audio clip's tokens) is
longer than a threshold therefore runs Ulysses sequence parallelism over a group of ``k`` ranks,
while short items run whole on one rank, in the same step. This module is the piece a router
calls for such an item; the router decides which items are long and who runs them.

``run_encoder_share(group, encoder, inputs)``, called by every member of ``group`` with the same
inputs (the item's full encoder inputs, or several long items collated):

1. ``split_rows`` cuts the sequence, in the encoder's share order (``ShardableEncoder.share_order``:
   input order, or a ViT's windows one after the other), into ``k`` contiguous shares of equal size
   ``chunk`` (whole features: the ViT's merge groups), the last ones short or empty: rank ``r`` holds rows
   ``[r * chunk, (r + 1) * chunk)`` clipped to the sequence. Its padding up to ``chunk`` rows
   therefore sits at global rows at or past the sequence's end, ``cu_seqlens[-1]``, exactly as the
   LLM's Ulysses pads a row: attention gives padding zero output, no real row attends to it,
   and its features are never produced, so it changes nothing (values or gradients).
2. The encoder (``forward(**inputs, share=RowShare(start, stop, handle))``) computes positions,
   RoPE and sample boundaries for the whole input, embeds and runs only its rows, and passes
   the share on in the ``SeqInfo`` its attention modules receive.
3. ``ShareAttention``, the encoder's ``attn_fn`` (installed once by ``apply_encoder_sp``), pads
   q/k/v to ``chunk`` rows and runs ``sequence.UlyssesAttention`` over the group: all-to-all to
   the whole sequence for ``heads / k`` heads, attention with the global ``cu_seqlens``,
   all-to-all back; everything else in the encoder is per row.
4. Each member returns the features of its own rows; in rank order they are the item's features.
   An encoder with a share order of its own (Qwen2.5-VL's windows) makes its share's features in
   that order, so one more all-to-all in the group (``_into_input_order``) puts them back: member
   ``r`` then returns input features ``[r * chunk, (r + 1) * chunk)`` (in rows per feature), as
   without a share order. Windows are read band by band (a row of windows across the frame, then
   the next), so a share of windows mostly covers the same input rows and few features move.

Gradients: every all-to-all is its own adjoint (``sequence._Exchange``), so after each member
backpropagates a loss on its chunk, the members' weight gradients sum to the one-rank gradient
(FSDP's gradient reduction combines them as it does any ranks' gradients). Rows that every member recomputes (the audio
stem) get gradient only through each member's own rows, so they are counted once too.

Why the share travels in ``SeqInfo`` and not by swapping ``attn_fn`` around the call: activation
checkpointing re-runs a block's forward during the backward pass, after a swap would have been
undone; ``SeqInfo`` is an argument of the block and is replayed with it. A share reaching the
model's default attention (``apply_encoder_sp`` not run) raises instead of attending wrongly.

What a runner group must guarantee: all ``k`` members call ``run_encoder_share`` with the same
group, the same encoder and identical inputs, in the same order relative to each other and to
every other collective on the group (several long items: the same item order); each member then
backpropagates through its returned chunk (a member whose chunk is empty returns zero rows and
still takes part in the backward all-to-alls, through ``0 * chunk.sum()`` or a real loss). When the
encoder is sharded by FSDP over more ranks than the group, every rank of the FSDP group must run
the encoder equally often (as ``colocate.py``'s dummy runs ensure for one call per step).

The recipe keys: ``parallel.encoder_sp`` (k) and ``parallel.encoder_sp_threshold`` (rows above
which an item is long), validated before workers start by ``check_encoder_sp`` (the model) and
``ParallelDims.resolve`` (k against the ranks); ``colocate.apply_media_routing`` installs them.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
import torch.nn.functional as F
from torch import nn

from veomni.contract.hooks import AttentionModule, AttentionSpec, AttentionWrapper, attention_modules
from veomni.contract.media import MediaHost, ShardableEncoder
from veomni.ops.attention import AttentionFn, RowShare, SeqInfo
from veomni.parallel.sequence import UlyssesAttention, kv_repeat_factor


@dataclass(frozen=True)
class RowShares:
    """How ``rows`` sequence rows split over ``ranks``: rank ``r`` holds ``held(r)``, every rank
    ``chunk`` rows after padding (``ranks * chunk - rows`` padding rows in all, at the end)."""

    rows: int
    ranks: int
    chunk: int
    rows_per_feature: int

    def held(self, rank: int) -> tuple[int, int]:
        """Rows ``[start, stop)`` of rank ``rank`` (empty for ranks past the sequence's end)."""
        return min(rank * self.chunk, self.rows), min((rank + 1) * self.chunk, self.rows)

    def feature_rows(self) -> list[int]:
        """Feature rows each rank returns, in rank order (they sum to the item's features)."""
        return [(stop - start) // self.rows_per_feature for start, stop in map(self.held, range(self.ranks))]


def split_rows(rows: int, rows_per_feature: int, ranks: int) -> RowShares:
    """Equal contiguous shares of whole features: ``chunk = ceil(features / ranks)`` features per
    rank, the last ranks holding fewer (padding). Pure. ValueError when the sequence is not made
    of whole features, or has fewer features than ranks (a rank would hold only padding: run the
    item on one rank; ``check_encoder_sp`` keeps the threshold above ``ranks`` features)."""
    if ranks < 1 or rows_per_feature < 1:
        raise ValueError(f"ranks ({ranks}) and rows_per_feature ({rows_per_feature}) must be >= 1")
    if rows % rows_per_feature:
        raise ValueError(f"{rows} sequence rows are not whole features of {rows_per_feature} rows each")
    features = rows // rows_per_feature
    if features < ranks:
        raise ValueError(f"an input of {features} feature(s) ({rows} rows) cannot be split over {ranks} ranks: "
                         "each rank needs at least one; run it whole on one rank (raise "
                         "parallel.encoder_sp_threshold to at least ranks * rows_per_feature)")
    return RowShares(rows, ranks, math.ceil(features / ranks) * rows_per_feature, rows_per_feature)


@dataclass(frozen=True)
class _ShareHandle:
    """The recipe's part of a ``RowShare``: the group that holds the other rows, and every
    member's padded row count."""

    group: dist.ProcessGroup
    chunk: int


class ShareAttention(AttentionWrapper):
    """An encoder attention module's ``attn_fn``: the model's own core on a whole sequence, or,
    when ``seq.share`` is set, Ulysses over the share's group (module docstring, step 3)."""

    def __init__(self, inner: AttentionFn, heads: AttentionSpec) -> None:
        self.inner = inner
        self.heads = heads

    def __call__(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, seq: SeqInfo) -> torch.Tensor:
        if seq.share is None:
            return self.inner(q, k, v, seq)
        handle = seq.share.handle
        if not isinstance(handle, _ShareHandle):
            raise TypeError(f"row share handle {type(handle).__name__} was not made by run_encoder_share")
        held = q.shape[0]
        padding = (0, 0, 0, 0, 0, handle.chunk - held)  # rows past cu_seqlens[-1] (module docstring)
        q, k, v = (F.pad(t, padding) for t in (q, k, v))
        repeat = kv_repeat_factor(self.heads.num_heads, self.heads.num_kv_heads, dist.get_world_size(handle.group))
        ulysses = UlyssesAttention(self.inner, handle.group, repeat)
        return ulysses(q, k, v, seq._replace(share=None))[:held]


def _encoders(model: nn.Module) -> dict[str, nn.Module]:
    """The model's encoders by module path (its plan's ``encoders``)."""
    return {path: model.get_submodule(path) for path in model.parallel_plan().encoders}


def _attention_modules(encoder: nn.Module) -> list[tuple[str, AttentionModule]]:
    return attention_modules(encoder, encoder.parallel_plan().attention)


def encoder_share_problems(name: str, encoder: nn.Module, ranks: int) -> list[str]:
    """Why ``encoder`` cannot run one input over ``ranks`` ranks (empty when it can)."""
    if not isinstance(encoder, ShardableEncoder):
        return [f"parallel.encoder_sp={ranks}: encoder {name} ({type(encoder).__name__}) cannot run on a share of "
                "its rows (it does not derive from veomni.contract.media.ShardableEncoder); use parallel.encoder_sp: 1"]
    try:
        modules = _attention_modules(encoder)
    except TypeError as error:  # a module that does not declare its heads
        return [f"parallel.encoder_sp={ranks}, encoder {name}: {error}"]
    if not modules:
        return [f"parallel.encoder_sp={ranks}: encoder {name} declares no attention modules in its parallel plan"]
    path, module = modules[0]  # an encoder's attention modules share their head counts
    heads = module.attention_spec()
    if heads.num_heads % ranks:
        divisors = [d for d in range(1, heads.num_heads + 1) if heads.num_heads % d == 0]
        return [f"parallel.encoder_sp={ranks} does not divide the {heads.num_heads} attention heads of "
                f"{name}.{path} (Ulysses gives each rank heads / encoder_sp of them); use one of "
                f"{', '.join(map(str, divisors))}"]
    try:
        kv_repeat_factor(heads.num_heads, heads.num_kv_heads, ranks)
    except ValueError as error:
        return [f"parallel.encoder_sp={ranks}, encoder {name}: {error}"]
    return []


def check_encoder_sp(model: nn.Module, encoder_sp: int, threshold: int) -> list[str]:
    """Problems with ``parallel.encoder_sp`` / ``parallel.encoder_sp_threshold`` for this model
    (built on the meta device is enough; empty when they fit). Pure: for the launcher, before any
    worker starts; the size against the ranks is ``ParallelDims.resolve``'s."""
    if encoder_sp <= 1:
        return []
    if not isinstance(model, MediaHost):
        return [f"parallel.encoder_sp: {type(model).__name__} runs no media encoders; remove the key"]
    problems = []
    for name, encoder in _encoders(model).items():
        found = encoder_share_problems(name, encoder, encoder_sp)
        problems += found
        if not found and threshold < encoder_sp * encoder.rows_per_feature:
            problems.append(f"parallel.encoder_sp_threshold={threshold} is below encoder_sp * rows per feature of "
                            f"{name} ({encoder_sp} * {encoder.rows_per_feature}): a long item must give every rank "
                            f"of the group at least one feature; use at least {encoder_sp * encoder.rows_per_feature}")
    return problems


def apply_encoder_sp(model: nn.Module) -> int:
    """Install ``ShareAttention`` on the attention modules of every shardable encoder of
    ``model`` (before activation checkpointing and compile, like the other injections);
    returns how many. Whole-item runs are unchanged: the wrapper passes them through."""
    count = 0
    for encoder in _encoders(model).values():
        if not isinstance(encoder, ShardableEncoder):
            continue
        for _, module in _attention_modules(encoder):
            if not isinstance(module.attn_fn, ShareAttention):
                module.attn_fn = ShareAttention(module.attn_fn, module.attention_spec())
                count += 1
    return count


def is_long_item(encoder: nn.Module, inputs: Mapping[str, torch.Tensor], threshold: int) -> bool:
    """Whether an item (its encoder inputs) runs sequence-parallel: a shardable encoder and more
    than ``threshold`` sequence rows."""
    return isinstance(encoder, ShardableEncoder) and encoder.sequence_rows(inputs) > threshold


def item_shares(encoder: nn.Module, inputs: Mapping[str, torch.Tensor], ranks: int) -> RowShares:
    """The split ``run_encoder_share`` makes of ``inputs`` over ``ranks`` ranks (pure; a router
    reads ``feature_rows()`` from it to know which features each member returns)."""
    if not isinstance(encoder, ShardableEncoder):
        raise TypeError(f"{type(encoder).__name__} cannot run on a share of its rows (not a ShardableEncoder)")
    return split_rows(encoder.sequence_rows(inputs), encoder.rows_per_feature, ranks)


def run_encoder_share(group: dist.ProcessGroup, encoder: nn.Module, inputs: Mapping[str, torch.Tensor]) -> torch.Tensor:
    """This rank's contiguous chunk of the features of ``inputs`` (every member of ``group``
    passes the same, whole inputs), differentiable; chunks in group-rank order concatenate to
    ``encoder(**inputs)``, whatever the encoder's share order. See the module docstring for what
    the group must guarantee."""
    shares = item_shares(encoder, inputs, dist.get_world_size(group))
    rank = dist.get_rank(group)
    start, stop = shares.held(rank)
    features = encoder(**inputs, share=RowShare(start, stop, _ShareHandle(group, shares.chunk)))
    expected = shares.feature_rows()[rank]
    if features.shape[0] != expected:
        raise ValueError(f"{type(encoder).__name__} returned {features.shape[0]} feature rows for rows "
                         f"[{start}, {stop}), expected {expected}")
    order = encoder.share_order(inputs)
    return features if order is None else _into_input_order(group, features, order, shares)


def _into_input_order(group: dist.ProcessGroup, features: torch.Tensor, order: torch.Tensor,
                      shares: RowShares) -> torch.Tensor:
    """This member's chunk of features in share order (``order[j]``: the input index of share
    feature ``j``) -> its chunk in input order, with the features exchanged within ``group``
    (differentiable: the gradients travel back the same way)."""
    total = shares.rows // shares.rows_per_feature
    order = torch.as_tensor(order, dtype=torch.long).cpu()
    if order.shape != (total,) or not torch.equal(order.sort().values, torch.arange(total)):
        raise ValueError(f"share_order must be a permutation of the {total} features of the input, "
                         f"got {tuple(order.shape)} indices")
    world, rank, chunk = dist.get_world_size(group), dist.get_rank(group), shares.chunk // shares.rows_per_feature
    made = order[rank * chunk:(rank + 1) * chunk]  # input index of each feature this member made
    sent = made.sort().indices  # grouped by the member returning it (input index // chunk), ascending
    source = order.argsort()[rank * chunk:(rank + 1) * chunk] // chunk  # who made each feature returned here
    received = funcol.all_to_all_single_autograd(
        features[sent.to(features.device)].contiguous(), torch.bincount(source, minlength=world).tolist(),
        torch.bincount(made // chunk, minlength=world).tolist(), group)
    arrival = source.sort(stable=True).indices  # by source, then input index: how they arrive
    return received[arrival.argsort().to(features.device)]
