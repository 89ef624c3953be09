"""No host synchronisation inside a training step's forward and backward (docs/performance.md):
on a GPU each one drains the kernel queue. ``HostSyncCounter`` sees them on a CPU too."""

from __future__ import annotations

import pytest
import torch

from harness.perf_models import MOE_OPTIONS, dit_batch, dit_step, llm_batch, llm_step, tiny_dit, tiny_llm
from veomni.ops.host_sync import HostSyncCounter

# Syncs allowed by name of the function they happen in (docs/performance.md); any other fails the test.
# The MoE's one-process dispatch needs none (fused grouped_mm); what does sync is documented there:
# grouped_mm's segment loop where no fused kernel applies, and expert parallelism's uneven
# all-to-all (its split sizes are host lists), neither on this path.
STEP_ALLOWED = {
    "count_loss_units": "the task reads its unit count before the forward, when no kernel is queued yet",
}


def test_counter_sees_each_kind_of_sync_and_names_the_caller():
    x = torch.tensor([1.0, 0.0, 2.0], requires_grad=True)
    with HostSyncCounter() as syncs:
        y = x * 2
        masked = y[y > 0].sum()  # boolean mask (forward and backward)
        scalar = int(y[0])
        y.tolist()
        torch.repeat_interleave(torch.tensor([1, 2]))
        torch.repeat_interleave(torch.tensor([1, 2]), output_size=3)  # sized: no sync
        torch.nonzero(y)
        (masked * scalar).backward()
    kinds = [sync.kind for sync in syncs.found]
    assert kinds == ["boolean mask indexing", "scalar read (.item() / int() / bool() / float())", "tolist",
                     "repeat_interleave without output_size", "nonzero", "boolean mask indexing"]
    assert {sync.function for sync in syncs.found} == {"test_counter_sees_each_kind_of_sync_and_names_the_caller"}
    assert syncs.outside({"test_counter_sees_each_kind_of_sync_and_names_the_caller": "test"}) == []


MODELS = {
    "llm": lambda: (tiny_llm(), llm_batch(), llm_step),
    "moe": lambda: (tiny_llm(MOE_OPTIONS), llm_batch(), llm_step),
    "dit": lambda: (tiny_dit(), dit_batch(), dit_step),
}


@pytest.mark.parametrize("family", sorted(MODELS))
def test_a_training_step_has_no_host_sync(family):
    model, batch, step = MODELS[family]()
    with HostSyncCounter() as syncs:
        step(model, batch)
    assert syncs.outside(STEP_ALLOWED) == [], "\n".join(map(str, syncs.outside(STEP_ALLOWED)))
