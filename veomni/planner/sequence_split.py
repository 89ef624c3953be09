"""``--dry-run``'s "sequence split" section: every way to split one row over the recipe's
``sp x cp`` ranks, with the attention traffic and the extra memory each costs a rank.

Methods listed for ``R = sp x cp`` ranks: Ulysses over ``R`` (only if the heads fit,
``sequence.kv_repeat_factor``), ring (``1 x R``), every Mesh-Attention shape ``a x b``, and the
hybrids ``sp' x`` (ring or mesh over ``R / sp'``) for each ``sp'`` the heads fit. Per rank, for
``T`` tokens per micro-batch padded as ``row_split`` pads them, ``c = T / cp`` tokens per cp
chunk and ``H' = H / sp``, ``Hkv' = Hkv x repeat / sp`` heads in the cp core (``e`` bytes per
element, ``L`` attention layers):

- communication per step: ``L x grad_accum x`` (forward + backward) of ``cp_cost.ulysses_bytes``
  (``T / R`` tokens) plus ``cp_cost.mesh_bytes`` (``c`` tokens); activation checkpointing runs
  the forward again in backward, so its forward bytes count twice:
  Ulysses forward = half its total, mesh forward = ``(a-1) c H' (2De + 4) + (b-1) 2 c Hkv' D e``;
- extra buffers (``context.py``'s ``_MeshAttention``; an upper bound, forward and backward peaks
  added): K/V chunks ``2 c Hkv' D e``, two while one is in flight round the column (``b > 1``),
  one otherwise; fp32 dK/dV ``2 c Hkv' D 4``; fp32 output (or dQ) accumulators with LSEs for
  the row's ``a`` query chunks, ``a c H' (D + 1) 4``; and the row's other ``a - 1`` query
  chunks saved for backward, ``(a-1) c H' D e`` for every layer (one layer under checkpointing,
  which frees them between layers). Ulysses adds none beyond its all-to-all copies.

Memory = the activations per rank (the family's estimate / ``R``, the same for every method)
plus those buffers. ``cp_mesh: []`` is chosen in the workers from the measured link bandwidth
and block time (``cp_cost.auto_cp_mesh``); a plan cannot measure, so it names both ends: ring
when compute hides the ring, the fewest-bytes shape when the link is the bottleneck.
"""

from __future__ import annotations

from dataclasses import dataclass

from veomni.parallel.cp_cost import choose_cp_mesh, mesh_bytes, mesh_shapes, ulysses_bytes
from veomni.parallel.row_split import RowSplit
from veomni.parallel.sequence import kv_repeat_factor

GiB = 2**30


@dataclass(frozen=True)
class AttentionShape:
    layers: int
    heads: int
    kv_heads: int
    head_dim: int


@dataclass(frozen=True)
class SplitCost:
    sp: int
    a: int
    b: int
    comm_bytes: int
    """Attention traffic one rank sends per step (all layers, forward + backward)."""
    buffer_bytes: int
    """Extra memory the method holds on a rank (on top of the activations)."""

    @property
    def cp(self) -> int:
        return self.a * self.b

    @property
    def name(self) -> str:
        core = "" if self.cp == 1 else "ring" if self.a == 1 else f"mesh {self.a}x{self.b}"
        if self.sp == 1:
            return core
        return "Ulysses" if self.cp == 1 else f"Ulysses {self.sp} x {core}"


def _kv_repeat(attn: AttentionShape, sp: int) -> int | None:
    try:
        return kv_repeat_factor(attn.heads, attn.kv_heads, sp)
    except ValueError:
        return None


def split_layouts(attn: AttentionShape, ranks: int) -> list[tuple[int, int, int]]:
    """``(sp, a, b)`` of every method that fits ``ranks`` ranks and the heads."""
    layouts = []
    for sp in range(1, ranks + 1):
        if ranks % sp or (sp > 1 and (attn.heads % sp or _kv_repeat(attn, sp) is None)):
            continue
        layouts += [(sp, 1, 1)] if sp == ranks else [(sp, a, b) for a, b in mesh_shapes(ranks // sp)]
    return layouts


def split_cost(attn: AttentionShape, tokens: int, sp: int, a: int, b: int, elem_bytes: int, checkpointing: str,
               grad_accum: int = 1) -> SplitCost:
    cp = a * b
    padded = RowSplit(sp=sp, cp=cp).padded(tokens)
    kv_heads = attn.kv_heads * (_kv_repeat(attn, sp) if sp > 1 else 1)
    d, e, rerun = attn.head_dim, elem_bytes, checkpointing != "none"
    per_layer = 0
    if sp > 1:
        total = ulysses_bytes(padded // (sp * cp), attn.heads, kv_heads, d, sp, e)
        per_layer += total + (total // 2 if rerun else 0)
    buffers = 0
    if cp > 1:
        c, heads, kv = padded // cp, attn.heads // sp, kv_heads // sp
        per_layer += sum(mesh_bytes(a, b, c, heads, kv, d, e).values())
        if rerun:
            per_layer += (a - 1) * c * heads * (2 * d * e + 4) + (b - 1) * 2 * c * kv * d * e
        kv_chunk = 2 * c * kv * d
        held_layers = 1 if rerun else attn.layers
        buffers = ((2 if b > 1 else 1) * kv_chunk * e + kv_chunk * 4 + a * c * heads * (d + 1) * 4
                   + (a - 1) * c * heads * d * e * held_layers)
    return SplitCost(sp, a, b, per_layer * attn.layers * grad_accum, buffers)


def sequence_split_lines(attn: AttentionShape, tokens: int, sp: int, cp: int, cp_mesh: tuple[int, int] | None,
                         elem_bytes: int, checkpointing: str, grad_accum: int, activation_bytes: float) -> list[str]:
    """The report section; ``activation_bytes`` per rank (already divided by ``sp x cp``)."""
    ranks = sp * cp
    dtype = {2: "bf16", 4: "fp32"}.get(elem_bytes, f"{elem_bytes}-byte")
    lines = [f"sequence split ({tokens:,} tokens per micro-batch over sp x cp = {ranks} ranks; {attn.layers} "
             f"attention layers, {attn.heads} heads / {attn.kv_heads} K/V heads x {attn.head_dim}, {dtype}):",
             f"  {'method':<26}{'sp':>4}{'cp':>4}  {'comm GiB/step':>14}{'buffers GiB':>13}{'act.+buf. GiB':>15}"]
    auto = None
    if cp > 1 and cp_mesh is None:
        repeat = _kv_repeat(attn, sp) or 1
        c = RowSplit(sp=sp, cp=cp).padded(tokens) // cp
        auto = choose_cp_mesh(cp, c, attn.heads // sp, attn.kv_heads * repeat // sp, attn.head_dim, elem_bytes,
                              bandwidth=1.0, compute_seconds=0.0)  # the link-bound end: fewest bytes
    mine = (sp, *(cp_mesh or auto or (1, 1)))
    for layout in split_layouts(attn, ranks):
        cost = split_cost(attn, tokens, *layout, elem_bytes, checkpointing, grad_accum)
        mark = "" if layout != mine else "  <- recipe" + (" (cp_mesh: [], if link-bound)" if auto else "")
        lines.append(f"  {cost.name:<26}{cost.sp:>4}{cost.cp:>4}  {cost.comm_bytes / GiB:>14.3f}"
                     f"{cost.buffer_bytes / GiB:>13.3f}{(activation_bytes + cost.buffer_bytes) / GiB:>15.3f}{mark}")
    if attn.heads % ranks or _kv_repeat(attn, ranks) is None:
        lines.append(f"  (no Ulysses over {ranks}: {attn.heads} heads / {attn.kv_heads} K/V heads do not split "
                     f"{ranks} ways)")
    if cp > 1 and cp_mesh is None:
        ends = (f"ring (1x{cp}) either way (also the fewest bytes here)" if auto == (1, cp) else
                f"{auto[0]}x{auto[1]} (fewest bytes) when the link is the bottleneck, ring (1x{cp}) when compute "
                "hides the ring's hops")
        lines.append(f"  cp_mesh: [] is chosen at start-up from the measured link bandwidth and block time: {ends}")
    lines.append("  comm: attention exchanges sent per rank, all layers, forward + backward"
                 + (" + the recomputed forward" if checkpointing != "none" else "")
                 + (f", x {grad_accum} micro-batches" if grad_accum > 1 else "")
                 + "; buffers: K/V in flight, fp32 dK/dV and accumulators, saved row queries (upper bound)")
    return lines
