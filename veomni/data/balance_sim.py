"""Simulating many data-parallel ranks to compare how micro-batches are formed, from one cost model.

Ranks synchronise every micro-batch, so what matters is how far the most expensive rank (and the
most expensive micro-batch of each round) sits above the mean. Three policies per step, each rank
drawing from its own independent seeded stream of samples:

- ``tokens``: greedy packing in stream order under the units cap (what the loader does today);
- ``cost-fill``: each rank fills its own micro-batches from its own window with ``fill_bins``;
- ``grouped``: groups of ranks fill all their micro-batches together with ``fill_bins``.

The stream is long-tailed and mixed: text lengths are lognormal and chunked at ``max_seq_len``, and
the share of samples carrying images changes from shard to shard. Nothing is timed; the numbers
depend only on the seed. ``scripts/bench_balance_sim.py`` prints them for 8 to 1024 ranks.
"""

from __future__ import annotations

import math
import random
from collections import Counter
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from functools import cache
from itertools import islice, repeat
from typing import NamedTuple

from veomni.data.balance import Candidate, fill_bins, imbalance, per_rank_costs

POLICIES = ("tokens", "cost-fill", "grouped")


class Sample(NamedTuple):  # a tuple: cheap to create by the million
    units: int  # LLM tokens plus encoder patches: what the per-micro-batch cap counts
    cost: float


@dataclass(frozen=True)
class CostModel:
    """Estimated compute of a sample, in FLOPs of one token through the LLM's dense layers.

    An image of ``p`` patches costs ``encoder_per_patch * p + encoder_attention * p**2`` in the
    encoder and puts ``p / patches_per_token`` placeholder tokens into the LLM sequence, whose
    ``n`` tokens cost ``per_token * n + attention * n**2``.
    """

    per_token: float = 1.0
    attention: float = 1 / 1560
    encoder_per_patch: float = 0.25
    encoder_attention: float = 1 / 4096
    patches_per_token: int = 4

    def sample(self, text_tokens: int, images: Sequence[int] = ()) -> Sample:
        if not images:
            return Sample(units=text_tokens, cost=self.per_token * text_tokens + self.attention * text_tokens**2)
        tokens = text_tokens + sum(images) // self.patches_per_token
        patches = sum(images)
        cost = (self.per_token * tokens + self.attention * tokens**2
                + self.encoder_per_patch * patches + self.encoder_attention * sum(p * p for p in images))
        return Sample(units=tokens + patches, cost=cost)

    def image_units(self, images: Sequence[int]) -> int:
        """Units the images take in a sample: their patches and their placeholder tokens."""
        return sum(images) + sum(images) // self.patches_per_token


@dataclass(frozen=True)
class DataMix:
    """A long-tailed text/image stream: documents of lognormal length, chunked so a sample holds at
    most ``max_seq_len`` units; every ``shard_documents`` documents the share of documents with
    images is drawn anew in ``[0, max_image_share]``; such a document carries 1 to ``max_images``
    images of ``min_patches`` to ``max_patches`` patches (log-uniform), all in its first chunk."""

    text_mu: float = 5.5
    text_sigma: float = 1.3
    max_seq_len: int = 4096
    shard_documents: int = 200
    max_image_share: float = 0.5
    max_images: int = 3
    min_patches: int = 64
    max_patches: int = 1024


def sample_stream(mix: DataMix, costs: CostModel, seed: int, rank: int) -> Iterator[Sample]:
    """Rank ``rank``'s endless stream, independent of every other rank's and fixed by ``seed``."""
    if costs.image_units([mix.max_patches] * mix.max_images) >= mix.max_seq_len:
        raise ValueError(f"{mix.max_images} images of {mix.max_patches} patches leave no room for text in "
                         f"a sample of {mix.max_seq_len} units")
    rng = random.Random(f"{seed}/{rank}")
    while True:
        yield from _shard(mix, costs, rng)


def _shard(mix: DataMix, costs: CostModel, rng: random.Random) -> list[Sample]:
    """The samples of ``mix.shard_documents`` documents sharing one image share."""
    text_only = _text_only_samples(costs, mix.max_seq_len)
    max_len = mix.max_seq_len
    image_share = rng.uniform(0.0, mix.max_image_share)
    lengths = [max(1, round(math.exp(rng.gauss(mix.text_mu, mix.text_sigma)))) for _ in range(mix.shard_documents)]
    samples: list[Sample] = []
    for text in lengths:
        chunked_from = 0
        if rng.random() < image_share:
            images = [round(math.exp(rng.uniform(math.log(mix.min_patches), math.log(mix.max_patches))))
                      for _ in range(rng.randint(1, mix.max_images))]
            chunked_from = min(text, max_len - costs.image_units(images))
            samples.append(costs.sample(chunked_from, images))
        elif text <= max_len:  # most documents: one text-only sample
            samples.append(text_only[text])
            continue
        samples.extend(text_only[min(max_len, text - start)] for start in range(chunked_from, text, max_len))
    return samples


@cache
def _text_only_samples(costs: CostModel, max_seq_len: int) -> list[Sample]:
    """Every text-only sample by its length: most samples are looked up here, not computed."""
    return [costs.sample(tokens) for tokens in range(max_seq_len + 1)]


@dataclass(frozen=True)
class SimConfig:
    """One simulated run: ``ranks`` ranks of ``micro_batches`` bins per step, each bin capped at
    ``unit_cap`` units and filled towards ``target`` (window policies; ``fill`` is measured against
    it for all), samples forced after ``max_wait`` steps, ranks grouped by ``group_size``."""

    ranks: int
    micro_batches: int = 4
    unit_cap: int = 16384
    target: float = 16384.0
    max_wait: int = 4
    group_size: int = 8
    window_steps: float = 2.0  # windows are topped up to this many steps' worth of cost and of bins
    steps: int = 10
    warmup_steps: int = 2
    seed: int = 0


@dataclass
class PolicyStats:
    """Per measured step: ``imbalance`` (max / mean rank cost over all ranks), ``sync`` (mean over
    the micro-batch rounds of the most expensive bin of the round, over the mean bin cost: ranks
    wait for each other every micro-batch) and ``fill`` (mean bin cost / target). ``waits`` counts
    the placed samples by the steps they waited; ``moved`` is how many were trained on a rank
    other than the one that drew them."""

    imbalance: list[float] = field(default_factory=list)
    sync: list[float] = field(default_factory=list)
    fill: list[float] = field(default_factory=list)
    waits: Counter[int] = field(default_factory=Counter)
    moved: int = 0

    @property
    def placed(self) -> int:
        return self.waits.total()

    @property
    def mean_wait(self) -> float:
        return sum(wait * count for wait, count in self.waits.items()) / max(self.placed, 1)

    @property
    def moved_share(self) -> float:
        return self.moved / max(self.placed, 1)


def simulate(
    config: SimConfig, mix: DataMix = DataMix(), costs: CostModel = CostModel(), policies: Sequence[str] = POLICIES
) -> dict[str, PolicyStats]:
    """Run each policy ``config.warmup_steps + config.steps`` steps on the same streams; measure the last ``steps``.

    Groups never interact, so the ranks are simulated one group at a time, each group's streams
    drawn once and replayed to every policy: memory stays flat at 1024 ranks.
    """
    if min(config.ranks, config.micro_batches, config.group_size, config.steps) < 1 or config.warmup_steps < 0:
        raise ValueError(f"need at least one rank, micro-batch, rank per group and measured step: {config}")
    if mix.max_seq_len > config.unit_cap:
        raise ValueError(f"samples of up to {mix.max_seq_len} units do not fit the cap of {config.unit_cap}")
    if unknown := set(policies) - set(POLICIES):
        raise ValueError(f"unknown policies {sorted(unknown)}, expected some of {POLICIES}")
    stats = {policy: PolicyStats() for policy in policies}
    step_bin_costs = {policy: [[] for _ in range(config.steps)] for policy in policies}
    for first in range(0, config.ranks, config.group_size):
        group = range(first, min(first + config.group_size, config.ranks))
        drawn = [_Replay(sample_stream(mix, costs, config.seed, rank)) for rank in group]
        for policy in policies:
            streams = [stream.reader() for stream in drawn]
            packer = _TokenPacking(streams, config) if policy == "tokens" else _WindowFilling(
                streams, config, 1 if policy == "cost-fill" else config.group_size)
            for step in range(config.warmup_steps + config.steps):
                result = packer.step()
                if step >= config.warmup_steps:
                    step_bin_costs[policy][step - config.warmup_steps].extend(result.bin_costs)
                    stats[policy].waits.update(result.waits)
                    stats[policy].moved += result.moved
    for policy, steps in step_bin_costs.items():
        for bin_costs in steps:
            _record(stats[policy], bin_costs, config)
    return stats


def _record(stats: PolicyStats, bin_costs: list[float], config: SimConfig) -> None:
    """One step over all ranks (bins ordered rank 0's micro-batches, then rank 1's, ...)."""
    rounds = config.micro_batches
    mean_bin = sum(bin_costs) / len(bin_costs)
    round_maxima = [max(bin_costs[round_::rounds]) for round_ in range(rounds)]
    stats.imbalance.append(imbalance(per_rank_costs(bin_costs, rounds)))
    stats.sync.append(sum(round_maxima) / rounds / mean_bin)
    stats.fill.append(mean_bin / config.target)


class _Replay:
    """A stream drawn once and read from its start by each policy."""

    def __init__(self, source: Iterator[Sample]) -> None:
        self.source = source
        self.drawn: list[Sample] = []

    def reader(self) -> Iterator[Sample]:
        position = 0
        while True:
            if position == len(self.drawn):
                self.drawn.extend(islice(self.source, 1024))
            yield self.drawn[position]
            position += 1


@dataclass(frozen=True)
class _Step:
    bin_costs: list[float]  # this step's bins of the simulated ranks: each rank's micro-batches in turn
    waits: Counter[int]
    moved: int


class _TokenPacking:
    """Each rank packs its stream in order: a sample that does not fit closes the micro-batch and
    opens the next one (it is kept across steps)."""

    def __init__(self, streams: list[Iterator[Sample]], config: SimConfig) -> None:
        self.streams = streams
        self.config = config
        self.carried = [next(stream) for stream in streams]

    def step(self) -> _Step:
        unit_cap = self.config.unit_cap
        bin_costs: list[float] = []
        placed = 0
        for rank, stream in enumerate(self.streams):
            sample = self.carried[rank]
            for _ in range(self.config.micro_batches):
                units, cost = 0, 0.0
                while units + sample.units <= unit_cap:
                    units, cost, placed = units + sample.units, cost + sample.cost, placed + 1
                    sample = next(stream)
                bin_costs.append(cost)
            self.carried[rank] = sample
        return _Step(bin_costs, Counter({0: placed}), 0)


class _WindowFilling:
    """Each rank keeps a window of pending samples with their ages, topped up before each step;
    each group of ``group_size`` ranks assigns its windows to its bins with ``fill_bins`` (a group
    of 1 fills only its own bins)."""

    def __init__(self, streams: list[Iterator[Sample]], config: SimConfig, group_size: int) -> None:
        self.streams = streams
        self.config = config
        self.group_size = group_size
        self.windows: list[list[Sample]] = [[] for _ in streams]
        self.ages: list[list[int]] = [[] for _ in streams]

    def step(self) -> _Step:
        micro_batches = self.config.micro_batches
        bin_costs: list[float] = []
        waits: Counter[int] = Counter()
        moved = 0
        for first in range(0, len(self.streams), self.group_size):
            group = range(first, min(first + self.group_size, len(self.streams)))
            for rank in group:
                self._top_up(rank)
            windows, ages = [self.windows[rank] for rank in group], [self.ages[rank] for rank in group]
            candidates: list[Candidate] = []
            for owner, (window, window_ages) in enumerate(zip(windows, ages)):
                units, costs = zip(*window)
                candidates.extend(map(Candidate, repeat(owner), range(len(window)), units, costs, window_ages))
            bins = fill_bins(candidates, len(group), micro_batches, self.config.unit_cap, self.config.target,
                             self.config.max_wait)
            chosen: list[set[int]] = [set() for _ in group]
            for b, contents in enumerate(bins):
                bin_costs.append(sum(windows[owner][index].cost for owner, index in contents))
                moved += sum(owner != b // micro_batches for owner, _ in contents)
                for owner, index in contents:
                    waits[ages[owner][index]] += 1
                    chosen[owner].add(index)
            for owner, rank in enumerate(group):
                self.windows[rank] = [s for index, s in enumerate(windows[owner]) if index not in chosen[owner]]
                self.ages[rank] = [age + 1 for index, age in enumerate(ages[owner]) if index not in chosen[owner]]
        return _Step(bin_costs, waits, moved)

    def _top_up(self, rank: int) -> None:
        want_cost = self.config.window_steps * self.config.micro_batches * self.config.target
        want_samples = self.config.window_steps * self.config.micro_batches
        window, ages, stream = self.windows[rank], self.ages[rank], self.streams[rank]
        cost = sum(sample.cost for sample in window)
        while cost < want_cost or len(window) < want_samples:
            sample = next(stream)
            window.append(sample)
            ages.append(0)
            cost += sample.cost
