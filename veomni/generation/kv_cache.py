"""The key/value cache, entered through the models' attention injection point.

Every decoder attention module of the zoo calls ``self.attn_fn(q, k, v, seq)`` on the keys and
values of the rows it was given, after RoPE (``veomni.contract.hooks.AttentionModule``). While
``kv_cache_attention`` is active each causal one runs a ``CachedAttention`` instead: it writes
the rows' keys and values into the cache at their sequence's slot and offset, then attends each
query to everything its sequence has cached up to and including itself. So a model needs no
cache argument and no change: the engine feeds only the new tokens with their positions, and
their attention sees the whole past. (Sequence and context parallelism's wrappers are unwound for
the duration, as in ``full_sequence_attention``: every rank generates whole sequences.)

``KVCache.step`` says where the current forward's rows go: one segment per sequence, ``lengths``
new rows at cache offset ``starts`` of slot ``slots``. A step whose segments all start at 0 (a
prefill) attends with the model's own core, exactly as without a cache; any other step (a decode
step, one row per sequence) attends over the slots' cached keys with SDPA under a per-sequence
causal mask.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from veomni.contract.hooks import AttentionModule, AttentionWrapper
from veomni.ops.attention import AttentionFn, SeqInfo


@dataclass(frozen=True)
class CacheStep:
    """Where one forward's packed rows live in the cache: segment ``s`` (rows ``cu[s]:cu[s+1]``)
    is ``lengths[s]`` new tokens of slot ``slots[s]``, written from offset ``starts[s]``."""

    slots: torch.Tensor
    starts: torch.Tensor
    lengths: torch.Tensor
    row_slot: torch.Tensor
    """[T] the slot of each row."""
    row_offset: torch.Tensor
    """[T] the cache offset each row is written to."""
    row_index: torch.Tensor
    """[T] each row's index within its segment."""
    row_segment: torch.Tensor
    """[T] each row's segment."""
    fresh: bool
    """Every segment starts at offset 0 (nothing cached before it)."""
    longest_new: int
    longest_total: int

    @classmethod
    def build(cls, slots: list[int], starts: list[int], lengths: list[int], device: torch.device) -> CacheStep:
        segment = torch.repeat_interleave(torch.arange(len(slots)), torch.tensor(lengths))
        first = torch.tensor([0, *lengths]).cumsum(0)[:-1]
        index = torch.arange(int(sum(lengths))) - first[segment]
        slot_t, start_t = torch.tensor(slots), torch.tensor(starts)
        on = {"device": device}
        return cls(slot_t.to(**on), start_t.to(**on), torch.tensor(lengths).to(**on), slot_t[segment].to(**on),
                   (start_t[segment] + index).to(**on), index.to(**on), segment.to(**on),
                   fresh=not any(starts), longest_new=max(lengths),
                   longest_total=max(s + n for s, n in zip(starts, lengths)))


class KVCache:
    """Keys and values of ``slots`` sequences of up to ``capacity`` tokens, per attention layer
    (allocated at the layer's first write, in its keys' dtype and device)."""

    def __init__(self, slots: int, capacity: int) -> None:
        self.slots, self.capacity = slots, capacity
        self.keys: dict[int, torch.Tensor] = {}
        self.values: dict[int, torch.Tensor] = {}
        self.step: CacheStep | None = None

    def store(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Write the step's rows ``k``/``v`` [T, Hkv, D]; the layer's whole keys and values
        [slots, capacity, Hkv, D]."""
        step = self.step
        if step is None:
            raise RuntimeError("KVCache.step is not set: the engine sets it before each forward")
        if layer not in self.keys:
            shape = (self.slots, self.capacity, *k.shape[1:])
            self.keys[layer] = k.new_zeros(shape)
            self.values[layer] = v.new_zeros(shape)
        keys, values = self.keys[layer], self.values[layer]
        keys[step.row_slot, step.row_offset] = k
        values[step.row_slot, step.row_offset] = v
        return keys, values

    def share(self, slots: list[int], copies: int, length: int) -> None:
        """Copy the first ``length`` positions of each of ``slots`` into the ``copies - 1`` slots after
        it, in every layer: continuations that share a prompt share its prefill."""
        layers = [*self.keys.values(), *self.values.values()]
        if copies == 1 or not layers:
            return
        source = torch.tensor(slots, device=layers[0].device)
        targets = (source[:, None] + torch.arange(1, copies, device=source.device)).flatten()
        for cached in layers:
            cached[targets, :length] = cached[source, :length].repeat_interleave(copies - 1, dim=0)


class CachedAttention(AttentionWrapper):
    """An attention module's ``attn_fn`` while generating: the rows' keys and values go into the
    cache, and each query attends to its sequence's cached keys up to its own offset."""

    def __init__(self, inner: AttentionFn, cache: KVCache, layer: int) -> None:
        self.inner, self.cache, self.layer = inner, cache, layer

    def __call__(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, seq: SeqInfo) -> torch.Tensor:
        keys, values = self.cache.store(self.layer, k, v)
        step = self.cache.step
        if step.fresh:
            return self.inner(q, k, v, seq)
        return attend_cached(q, keys, values, step)


def attend_cached(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, step: CacheStep) -> torch.Tensor:
    """q [T, Hq, D] of the step's rows against their slots' cached keys/values -> [T, Hq, D].

    Queries are laid out [segments, longest new, Hq, D] (one SDPA call); a query at index i of a
    segment starting at offset s sees cache offsets 0..s+i; the padding queries of shorter
    segments see offset 0 only (finite, and dropped)."""
    segments, total = step.slots.shape[0], step.longest_total
    padded = q.new_zeros(segments, step.longest_new, *q.shape[1:])
    padded[step.row_segment, step.row_index] = q
    k, v = keys[step.slots, :total], values[step.slots, :total]
    index = torch.arange(step.longest_new, device=q.device)
    last_index = torch.minimum(index[None, :], (step.lengths - 1)[:, None])
    visible = torch.arange(total, device=q.device)[None, None, :] <= (step.starts[:, None] + last_index)[:, :, None]
    out = F.scaled_dot_product_attention(padded.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                         attn_mask=visible[:, None], enable_gqa=True)
    return out.transpose(1, 2)[step.row_segment, step.row_index]


def _core(fn: AttentionFn) -> AttentionFn:
    while isinstance(fn, AttentionWrapper):
        fn = fn.inner
    return fn


def causal_attention_modules(model: nn.Module) -> list[AttentionModule]:
    """The model's causal attention modules in module order (an encoder's full attention is no
    decoder's: it runs once, on the prompt's media, and keeps its own ``attn_fn``)."""
    return [m for m in model.modules() if isinstance(m, AttentionModule) and m.attention_spec().causal]


@contextmanager
def kv_cache_attention(model: nn.Module, cache: KVCache) -> Iterator[None]:
    """Run ``model``'s causal attention modules through ``cache`` for the duration."""
    modules = causal_attention_modules(model)
    if not modules:
        raise TypeError(f"{type(model).__name__} has no causal attention module (an AttentionModule whose "
                        "attention_spec() is causal): there is nothing to cache, so it cannot generate")
    saved = [m.attn_fn for m in modules]
    for layer, module in enumerate(modules):
        module.attn_fn = CachedAttention(_core(module.attn_fn), cache, layer)
    try:
        yield
    finally:
        for module, fn in zip(modules, saved):
            module.attn_fn = fn
