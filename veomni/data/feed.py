"""The step's micro-batches from the train loader, and what the step's data was.

The trainer asks for ``grad_accum`` micro-batches per step: as the loader packed them, or, with
``data.balance``, balanced across the rank's group by ``veomni.data.group_reorder`` (the loader
then yields single samples, and this module gives the reordering the family's cost model). A
micro-batch says how many of its samples each source gave (``SOURCE_COUNTS``); that is removed
here before the task sees the batch and summed over the data-parallel ranks (by the trainer's
``reduce``) into the realised mixture ``mix_<source>`` (the share of the step's samples), reported
when a run mixes sources. Bad records are acted on the same way: each micro-batch carries its
consumer's counts (``READ_COUNTS``), and the step sums them over the data-parallel ranks, reports
``bad_records`` and stops every rank alike once the run's bad share passes ``data.max_bad_fraction``
(one rank's share of the data may be worse than the whole's). What producing a micro-batch cost
(``STEP_STATS``: rows read, cache hits) is summed the same way. A data concern, so it sits with the
dataset kinds it feeds from.
"""

from __future__ import annotations

import logging
from collections import Counter
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from veomni.config.schema import RunConfig
from veomni.contract import build_model
from veomni.data.group_reorder import GroupReorder, balance_group_size, balance_groups
from veomni.data.kinds import STEP_STATS
from veomni.data.mixture import run_sources
from veomni.data.sources import MIN_RECORDS_FOR_EARLY_CHECK, BadDataError
from veomni.data.text.packed import READ_COUNTS, SOURCE_COUNTS, Drawn, PackedTextDataset
from veomni.parallel.mesh import ParallelMeshes

logger = logging.getLogger(__name__)

ReduceValues = Callable[..., list[float]]
"""``reduce(values, group=, device=)``: the values summed over the group's ranks."""


class DataFeed:
    def __init__(self, next_step: Callable[[], list[dict]], sources: list[str], dp_group: Any,
                 device: torch.device, reduce: ReduceValues, reorder: GroupReorder | None = None,
                 max_bad_fraction: float | None = None) -> None:
        """``max_bad_fraction``: the run's bad share that stops it, summed over the ranks; None when the
        loader's consumers check their own."""
        self._next_step = next_step
        self.sources = sources
        self.dp_group = dp_group
        self.device = device
        self.reduce = reduce
        self.reorder = reorder
        self.max_bad_fraction = max_bad_fraction
        self._counts: Counter = Counter()
        self._stats: dict[str, list[float]] = {}  # name -> [sum] or [numerator, denominator]
        self._read: list[Any] = [0, 0, 0, "", 0]  # this rank's newest READ_COUNTS

    def next_step(self) -> list[dict[str, Any]]:
        """This rank's micro-batches of the next step."""
        batches = self._next_step()
        for batch in batches:
            self._counts.update(batch.pop(SOURCE_COUNTS, {}))
            for name, value in batch.pop(STEP_STATS, {}).items():
                parts = [float(v) for v in value] if isinstance(value, (list, tuple)) else [float(value)]
                total = self._stats.setdefault(name, [0.0] * len(parts))
                self._stats[name] = [a + b for a, b in zip(total, parts)]
            self._read = batch.pop(READ_COUNTS, self._read)
        return batches

    def step_metrics(self) -> dict[str, float]:
        """``mix_<source>``: each source's share of the samples of the steps since the last call, over
        every data-parallel rank (none when the run reads one source); ``bad_records``: the run's, summed
        over the ranks, which stops it past ``max_bad_fraction``; the balancing estimates of this rank's
        group; each ``STEP_STATS`` name (a sum, or a ratio of sums). One all-reduce, or none."""
        counts, self._counts = self._counts, Counter()
        stats, self._stats = self._stats, {}
        metrics = dict(self.reorder.last) if self.reorder is not None else {}
        mixed = len(self.sources) >= 2
        if not mixed and self.max_bad_fraction is None and not stats:
            return metrics
        values = [float(counts[name]) for name in self.sources] if mixed else []
        read = [float(v) for v in self._read[:3]] if self.max_bad_fraction is not None else []
        names = sorted(stats)  # every rank's kind reports the same names
        summed = [v for name in names for v in stats[name]]
        totals = self.reduce(values + read + summed, group=self.dp_group, device=self.device)
        if read:
            metrics["bad_records"] = self._check_bad(*totals[len(values):len(values) + 3])
        stat_totals = iter(totals[len(values) + len(read):])
        for name in names:
            parts = [next(stat_totals) for _ in stats[name]]
            metrics[name] = parts[0] if len(parts) == 1 else parts[0] / max(parts[1], 1e-12)
        mix = totals[:len(values)]
        drawn = sum(mix) or 1.0
        return metrics | {f"mix_{name}": total / drawn for name, total in zip(self.sources, mix)}

    def _check_bad(self, records: float, bad: float, passes: float) -> float:
        """``bad``, once the run has read enough to judge (or every rank ended a pass) and is within its
        limit; every rank gets the same sums, so every rank stops alike."""
        ranks = dist.get_world_size(self.dp_group) if dist.is_initialized() else 1
        judged = records >= MIN_RECORDS_FOR_EARLY_CHECK or passes >= ranks
        if records and judged and bad / records > self.max_bad_fraction:
            worst = [tuple(self._read[3:])]
            if ranks > 1:  # every rank is here at the same step: name the run's worst file on each
                worst = [None] * ranks
                dist.all_gather_object(worst, tuple(self._read[3:]), group=self.dp_group)
            file, count = max(worst, key=lambda found: found[1])
            raise BadDataError(f"{bad:.0f} of {records:.0f} records were bad ({bad / records:.1%} > "
                               f"data.max_bad_fraction {self.max_bad_fraction:.1%}), summed over the run's "
                               f"{ranks} data-parallel rank(s); worst file {file} ({count} bad in its current pass)")
        return bad

    def pending_state(self) -> list[list[Any]]:
        """Samples drawn from the loader but not trained yet (the balancing window); [] without balancing."""
        return self.reorder.state_dict() if self.reorder is not None else []


def build_feed(cfg: RunConfig, loader: Any, meshes: ParallelMeshes, spec: Any, device: torch.device,
               pending: list[list[Any]], reduce: ReduceValues) -> DataFeed:
    """The run's feed: plain, or balanced (``data.balance``) with the restored window ``pending``;
    ``reduce`` sums values over a group (the trainer's ``all_reduce_values``)."""
    dataset = loader.dataset
    # the run sums bad records where batches carry their consumer's counts: not a balanced feed's
    # samples packed here from loader workers, whose positions this process's dataset does not see
    run_counts = isinstance(dataset, PackedTextDataset) and not (cfg.data.balance and cfg.data.num_workers)
    if run_counts:
        dataset.run_counts_bad = True
    limit = cfg.data.max_bad_fraction if run_counts else None
    reorder = balanced_feed(cfg, loader, meshes, spec, pending) if cfg.data.balance else None
    sources = [source.name for source in run_sources(cfg.data, "train")]
    if reorder is not None:
        return DataFeed(reorder.next_step, sources, meshes.dp.get_group(), device, reduce, reorder, limit)
    it = iter(loader)
    return DataFeed(lambda: [next(it) for _ in range(cfg.train.grad_accum)], sources, meshes.dp.get_group(), device,
                    reduce, max_bad_fraction=limit)


def balanced_feed(cfg: RunConfig, loader: Any, meshes: ParallelMeshes, spec: Any,
                  pending: list[list[Any]]) -> GroupReorder:
    """The group reordering of this rank: the family's cost per sample and the micro-batch target
    (from a meta build of the model), its group (gloo), the restored window."""
    with torch.device("meta"):
        _, meta_model = build_model(cfg.model.arch, cfg.model.options)
    dataset: PackedTextDataset = loader.dataset
    target, cost_of = sample_costs(spec, meta_model, dataset)
    dims = meshes.dims
    size = balance_group_size(cfg.data.balance_group, dims.dp_size, dims.world_size // dims.pp // dims.dp_size)
    group = None
    if size > 1:
        group, _ = dist.new_subgroups_by_enumeration(balance_groups(meshes.dp_rank_lists(), size), backend="gloo")
    reorder = GroupReorder(dataset, iter(loader), cfg.train.grad_accum, cost_of, target, cfg.data.balance_max_wait,
                           group)
    reorder.load_state_dict(pending)
    logger.info("data balancing: groups of %d data-parallel rank(s), target %.3g FLOPs per micro-batch", size, target)
    return reorder


def sample_costs(spec: Any, model: nn.Module, dataset: PackedTextDataset) -> tuple[float, Callable[[Drawn], float]]:
    """(the micro-batch target, a sample's estimated FLOPs) from the family's cost model. The target is
    the dense (linear) work of ``tokens_per_micro_batch`` units: ``3 f(1) - f(2)`` per unit for a cost
    ``f(n) = a n + b n (n + 1) / 2``."""
    per_unit = 3 * spec.cost.sample_flops(model, 1) - spec.cost.sample_flops(model, 2)
    budget, longest = dataset.cfg.tokens_per_micro_batch, dataset.cfg.max_seq_len
    target = per_unit * budget
    heaviest = spec.cost.sample_flops(model, longest)
    if heaviest > target:
        logger.warning("data balancing: a sample of data.max_seq_len=%d tokens costs %.2fx the micro-batch target; "
                       "such samples sit alone in a micro-batch and set the pace. Raise data.tokens_per_micro_batch "
                       "to >= %d (or lower max_seq_len)", longest, heaviest / target, int(heaviest / per_unit) + 1)

    def cost_of(drawn: Drawn) -> float:
        batch = dataset.pack_drawn([drawn])
        return float(spec.cost.batch_flops(model, batch))

    return target, cost_of
