"""Build a sharded model without any rank holding more than its shards (rank 0 aside).

Rank 0 builds the full model on CPU and initialises it (seeded, or from Hugging Face
weights); every rank builds the same model on the meta device, applies the parallel recipe,
allocates only its own shards, and receives their values from rank 0 by broadcast. Peak
host memory is one full model on rank 0 and one shard elsewhere, and the weights are
exactly those of a single-process run with the same seed.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict


def build_sharded(
    build: Callable[[], nn.Module],
    initialise: Callable[[nn.Module], None],
    parallelize: Callable[[nn.Module], nn.Module],
    device: torch.device,
) -> nn.Module:
    """``build()`` makes the plain model; ``initialise`` fills a CPU copy (rank 0 only);
    ``parallelize`` applies the recipe to the meta copy on every rank."""
    return build_sharded_parts(build, initialise, [parallelize], device)[0]


def build_sharded_parts(
    build: Callable[[], nn.Module],
    initialise: Callable[[nn.Module], None],
    parallelize_parts: list[Callable[[nn.Module], nn.Module]],
    device: torch.device,
    strict: bool = True,
) -> list[nn.Module]:
    """One module per entry of ``parallelize_parts``, each made from a fresh meta model (e.g.
    cut to a pipeline stage, then sharded) and filled from rank 0's one full initialised copy.
    Ranks may hold different parts (their parameter names select what they receive) but must
    hold the same number: each part is one broadcast of the full state that all ranks join.
    ``strict=False`` for parts holding a subset of the parameters (pipeline stages): the full
    state then has keys a part lacks."""
    full_state = {}
    if dist.get_rank() == 0:
        with torch.device("cpu"):
            reference = build()
        initialise(reference)
        full_state = reference.state_dict()
    parts = []
    for parallelize in parallelize_parts:
        with torch.device("meta"):
            model = build()
        model = parallelize(model)
        model.to_empty(device=device)
        set_model_state_dict(
            # a copy: loading replaces the dict's entries with this part's sharded tensors
            model, dict(full_state), options=StateDictOptions(full_state_dict=True, broadcast_from_rank0=True,
                                                              strict=strict)
        )
        parts.append(model)
    return parts
