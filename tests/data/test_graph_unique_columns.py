"""Distinct edges and send pairs through one 1-D unique of pair keys (``unique_columns``): the same
columns, order and slots as ``torch.unique(dim=1)``, without its per-column tensor objects (on a
10M-edge graph they left 2.3 GiB resident after set-up, docs/gnn.md); the set-up of a graph runs no
``unique_dim``, so a change back shows here, not only in a large run's peak memory."""

from __future__ import annotations

import pytest
import torch

from veomni.data.graph.views import KEY_BOUND, edge_weights, partition_views, unique_columns
from veomni.ops.cost_probes import aten_ops


@pytest.mark.parametrize("bound", [50, KEY_BOUND + 1], ids=["keys", "past-the-key-bound"])
def test_unique_columns_equal_torch_unique_over_columns(bound: int) -> None:
    generator = torch.Generator().manual_seed(0)
    pairs = torch.randint(0, 50, (2, 3_000), generator=generator)  # many repeated columns
    want, want_slot = torch.unique(pairs, dim=1, return_inverse=True)
    got, slot = unique_columns(pairs.int(), bound, return_inverse=True)
    assert got.dtype == torch.int64 and torch.equal(got, want) and torch.equal(slot, want_slot)
    assert torch.equal(got[:, slot], pairs)


def test_graph_set_up_runs_no_unique_over_columns() -> None:
    generator = torch.Generator().manual_seed(1)
    nodes, parts = 40, 2
    edge_index = torch.randint(0, nodes, (2, 300), generator=generator)
    part, chunk = torch.arange(nodes) % parts, torch.arange(nodes) % 3

    def set_up() -> None:
        edges, weights = edge_weights(edge_index, nodes, "gcn")
        partition_views(edges, weights, {"x": torch.randn(nodes, 4)}, part, parts, 0, chunk, 3)

    ops = aten_ops(set_up)
    assert ops["aten._unique2"] >= 2, ops  # the edges and the send pairs, as 1-D keys
    assert not [name for name in ops if "unique_dim" in name], ops
