"""``--dry-run`` lines for sampled mini-batch graph training (``data.graph_fanouts``): the memory
a rank holds and the feature bytes an epoch reads, before any graph is built.

Estimates (N nodes, E edges, D = E / N, F features, P data-parallel ranks, B targets per
mini-batch, fanouts f_1..f_L):

- input nodes of a mini-batch: n_0 = B, n_l = min(N, n_(l-1) (1 + min(f_l, D))) (every sampled
  neighbour counted new: an upper estimate; overlap and a proximity order lower it);
- mini-batches per rank per epoch: the targets / (P B), the targets being the labelled nodes of the
  folder's manifest (an upper bound: training is a share of them), else every node;
- feature bytes per epoch (all ranks, no cache): mini-batches x n_L x F x 4; a cache of hit rate h
  reads (1 - h) of it (the metrics report the measured ``feature_bytes_read``);
- memory per rank: the graph's structure (every rank holds it: E sources, destinations and
  weights, 20 bytes an edge), the features (N F 4 in memory; none resident memory-mapped), the
  cache table (rows x F x 4, on the training device), one mini-batch's activations.
"""

from __future__ import annotations

import math

from veomni.config.schema import RunConfig

GiB = 2**30


def input_nodes(batch: int, fanouts: list[int], nodes: int, degree: float) -> list[int]:
    """[n_0, ..., n_L]: targets, then the estimated input nodes after each hop (module docstring)."""
    sizes = [min(batch, nodes)]
    for fanout in fanouts:
        reach = degree if fanout == -1 else min(fanout, degree)
        sizes.append(min(nodes, math.ceil(sizes[-1] * (1 + reach))))
    return sizes


def sampled_plan_lines(cfg: RunConfig, parts: int, nodes: int, edges: int, features: int, labelled: int | None,
                       activation_bytes_per_node: float) -> list[str]:
    data = cfg.data
    sizes = input_nodes(data.graph_batch_size, data.graph_fanouts, nodes, edges / max(nodes, 1))
    targets = labelled if labelled is not None else nodes
    batches = math.ceil(targets / parts / data.graph_batch_size)
    row = features * 4
    epoch_bytes = batches * parts * sizes[-1] * row
    resident = 0 if data.graph_features == "mmap" else nodes * row
    structure = edges * 20 + nodes * 24  # edges: source, destination, weight; nodes: degree, start, labels
    cache = data.graph_cache_rows * row
    activations = activation_bytes_per_node * sizes[-1]

    def gb(value: float) -> str:
        return f"{value / GiB:.3f} GiB"

    counted = "the manifest's labelled nodes as targets" if labelled is not None else "every node counted a target"
    return [
        f"sampling      fanouts {data.graph_fanouts}, {data.graph_batch_size:,} targets per mini-batch per rank, "
        f"{parts} partition(s); order {data.graph_batch_order}; features {data.graph_features}",
        f"mini-batch    ~{sizes[-1]:,} input nodes (per hop, upper estimate: {' -> '.join(f'{n:,}' for n in sizes)})",
        f"epoch         {batches:,} mini-batches per rank ({counted})",
        f"bytes / epoch feature rows read, all ranks, no cache: {gb(epoch_bytes)} ({row} bytes a row); a cache of hit "
        "rate h reads (1 - h) of it (measured: feature_bytes_read)",
        "memory / rank (sampled training):",
        *(f"  {label:<44} {gb(value)}" for label, value in (
            ("graph structure (every rank holds it)", structure),
            (f"features ({data.graph_features}{': pages read only' if not resident else ''})", resident),
            (f"feature cache ({data.graph_cache_rows:,} rows, training device)", cache),
            ("one mini-batch's activations", activations),
            ("total", structure + resident + cache + activations))),
    ]
