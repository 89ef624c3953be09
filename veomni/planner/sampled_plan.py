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
- memory per rank: the graph's structure (every rank holds it, ``structure_bytes``), the features
  (N F 4 in memory; none resident memory-mapped), the cache (its table of rows x F x 4 on the
  training device, a node and a stamp per row and a slot per node, 8 bytes each), one
  mini-batch's activations.
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


def structure_bytes(nodes: int, edges: int, samplers: int, proximity: bool) -> int:
    """Bytes of the graph's structure a rank holds while it samples, all int64 ids and fp32 weights
    (``tests/data/test_graph_sampled_memory.py`` holds it to the tensors a built run keeps):

    - per edge: the normalised in-edges' sources and weights, by destination (12; duplicates
      merged, a GCN's self-loops added: taken as E), which every sampler of the process shares
      (``veomni.data.graph.source.sampled_graph``; the edge list as loaded is not kept); the
      proximity order's undirected neighbour list (16, an upper estimate: 8 when every edge has its
      reverse, as in an undirected graph stored both ways);
    - per node: labels and the three split masks (11), partition (8), in-degree and start (16), each
      sampler's labels (8; evaluation's two sets, 16); the proximity order's degree, start and
      component (24).
    """
    per_edge = 12 + (16 if proximity else 0)
    per_node = 35 + 8 * samplers + 8 * (samplers - 1) + (24 if proximity else 0)
    return edges * per_edge + nodes * per_node


def sampled_plan_lines(cfg: RunConfig, parts: int, nodes: int, edges: int, features: int, labelled: int | None,
                       activation_bytes_per_node: float) -> list[str]:
    data = cfg.data
    sizes = input_nodes(data.graph_batch_size, data.graph_fanouts, nodes, edges / max(nodes, 1))
    targets = labelled if labelled is not None else nodes
    batches = math.ceil(targets / parts / data.graph_batch_size)
    row = features * 4
    epoch_bytes = batches * parts * sizes[-1] * row
    resident = 0 if data.graph_features == "mmap" else nodes * row
    samplers = 2 if data.eval_path else 1  # the run evaluates (at the end at least) when it has an eval split
    structure = structure_bytes(nodes, edges, samplers, data.graph_batch_order == "proximity")
    cache = data.graph_cache_rows * (row + 16) + (nodes * 8 if data.graph_cache_rows else 0)  # + slot index
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
