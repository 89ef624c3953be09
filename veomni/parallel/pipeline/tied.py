"""Parameters tied across pipeline stages (a tied input embedding and output head), as Megatron does.

A model like ``DecoderLM(tie_embeddings=True)`` uses one parameter under two names in different
stage pieces: ``embed_tokens.weight`` (first stage) and ``lm_head.weight`` (last stage). Cut into
stages, each stage that holds one of the names keeps its own copy, under that name, filled from
rank 0's one initialised model (``materialize.py``: its full state dict has both names), so the
copies start equal. After each step's backward ``TiedCopies.sync`` sums the copies' gradients
over the pipeline ranks holding them (one small process group per data-parallel position, made
once; the V schedules hold both copies on one rank and sum locally), so every copy carries the
one-process gradient and the optimizer keeps them equal. Under FSDP the copies are DTensors
sharded alike over their stage's mesh: their local shards are summed. A frozen tie (a LoRA
run's base embedding and head) has no gradient to sum: ``sync`` leaves it without one, rather
than giving a parameter that does not train a zero gradient.

Grad-norm clipping counts the tied gradient once (``uncounted``: the copies after the first
are left out of the norm, still clipped). Checkpoints hold each stage's own name; a checkpoint
missing one name of a group (saved by one process, whose optimizer keys the group by its first
name) is read through another name of the group (``checkpoint.manager``).

Supported: names in the pieces before and after the blocks container (on the first and last
stage). A parameter shared with a block, or a graph model's tied pieces, is refused.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
import torch.distributed as dist
from torch import nn

from veomni.contract.plan import ParallelPlan
from veomni.parallel.pipeline.layout import PipelineConfigError


def tied_names(model: nn.Module) -> list[list[str]]:
    """Each group of names that one parameter has in ``model`` (groups of one left out)."""
    names: dict[int, list[str]] = {}
    for name, param in model.named_parameters(remove_duplicate=False):
        names.setdefault(id(param), []).append(name)
    return [group for group in names.values() if len(group) > 1]


def _piece(name: str, plan: ParallelPlan) -> str | None:
    return next((p for p in plan.stages if name == p or name.startswith(p + ".")), None)


def tied_across_pieces(model: nn.Module, plan: ParallelPlan) -> list[list[str]]:
    """The groups of ``tied_names`` whose names lie in different stage pieces."""
    return [group for group in tied_names(model) if len({_piece(n, plan) for n in group}) > 1]


def check_tied(model: nn.Module, plan: ParallelPlan, container: str) -> None:
    """Refuse the sharing patterns stage cutting cannot keep: a parameter shared between a block and
    anything else (blocks spread over stages), one outside every stage piece, or pieces tied in a
    graph model (whose chunk pipeline does not sync copies)."""
    def place(name: str) -> str | None:  # the piece, or within the container the block
        piece = _piece(name, plan)
        return f"{container}.{name[len(container) + 1:].split('.')[0]}" if piece == container else piece

    for group in tied_names(model):
        places = {place(n) for n in group}
        if len(places) == 1 and None not in places:
            continue
        if plan.message_passing or None in places or any(p.startswith(container + ".") for p in places if p):
            raise PipelineConfigError(
                f"parameters shared between pipeline pieces: {' = '.join(group)}; a pipeline keeps copies of "
                "parameters tied between the pieces before and after the blocks (a tied embedding and head) "
                "of a decoder, not this pattern; untie them or set parallel.pp=1")


def tied_stage(name: str, plan: ParallelPlan, container: str, n_stages: int) -> int:
    """The global stage holding ``name`` (a piece before the container: the first; after: the last)."""
    return 0 if plan.stages.index(_piece(name, plan)) < plan.stages.index(container) else n_stages - 1


class TiedCopies:
    """This rank's copies of the tied parameters and how their gradients are summed.

    ``groups``: per tie group, ``{global stage: name}`` for the stages holding a copy (names of one
    stage share a parameter there, so one per stage). Every rank must build this at once (the
    process groups are created over the world in the same order)."""

    def __init__(self, groups: list[dict[int, str]], parts: list[nn.Module], stage_indices: list[int],
                 owner: dict[int, int], pp_group: dist.ProcessGroup) -> None:
        by_stage = dict(zip(stage_indices, parts))
        self._groups: list[tuple[list[nn.Parameter], dist.ProcessGroup | None]] = []
        self.uncounted: list[nn.Parameter] = []
        """The copies past each group's first stage: clipped, but left out of the gradient norm."""
        pp_ranks = dist.get_process_group_ranks(pp_group)
        every_pipeline = [None] * dist.get_world_size()
        dist.all_gather_object(every_pipeline, pp_ranks)
        pipelines = sorted({tuple(p) for p in every_pipeline})
        for copies in groups:
            holders = sorted({owner[stage] for stage in copies})
            group = None
            if len(holders) > 1:  # one group per pipeline (data-parallel position), made by every rank
                group, _ = dist.new_subgroups_by_enumeration([[p[r] for r in holders] for p in pipelines])
            mine = sorted((stage, name) for stage, name in copies.items() if stage in by_stage)
            local = [_parameter(by_stage[stage], name) for stage, name in mine]
            self.uncounted += [p for (stage, _), p in zip(mine, local) if stage != min(copies)]
            if local and local[0].requires_grad:  # a frozen tie (a LoRA base's embedding) gets no gradient
                self._groups.append((local, group))

    @torch.no_grad()
    def sync(self) -> None:
        """Give every copy the sum of the copies' gradients (the one-process gradient)."""
        for params, group in self._groups:
            grads = []
            for p in params:
                if p.grad is None:
                    p.grad = torch.zeros_like(p)
                grads.append(_local(p.grad))
            total = grads[0] if len(grads) == 1 else torch.stack(grads).sum(0)
            if group is not None:
                dist.all_reduce(total, group=group)
            for g in grads:
                if g is not total:
                    g.copy_(total)


def _local(tensor: torch.Tensor) -> torch.Tensor:
    """A DTensor's local shard (the same storage), else the tensor."""
    return tensor.to_local() if hasattr(tensor, "to_local") else tensor


def _parameter(part: nn.Module, name: str) -> nn.Parameter:
    """``part``'s parameter named ``name`` in one process (wrappers' path segments ignored)."""
    for full, param in part.named_parameters():
        if full.replace("_checkpoint_wrapped_module.", "").replace("_orig_mod.", "") == name:
            return param
    raise KeyError(f"stage module holds no parameter {name}")


def aliases(groups: Iterable[list[str]]) -> dict[str, list[str]]:
    """For each tied name, the other names of its group (checkpoint keys to read it through)."""
    return {name: [other for other in group if other != name] for group in groups for name in group}
