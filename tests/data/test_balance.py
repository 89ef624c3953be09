"""Cost-balanced micro-batches: fill_bins' guarantees on random and adversarial windows, and the
simulation showing grouped filling balances ranks where token packing does not."""

from __future__ import annotations

import math
import random
from itertools import islice
from statistics import mean

import pytest

from veomni.data.balance import Candidate, fill_bins, imbalance, per_rank_costs
from veomni.data.balance_sim import CostModel, DataMix, SimConfig, sample_stream, simulate


def random_window(rng: random.Random, ranks: int, per_rank: int, unit_cap: int, max_age: int) -> list[Candidate]:
    """Long-tailed costs (some repeated exactly, to exercise ties) and units up to the cap."""
    candidates = []
    for owner in range(ranks):
        for index in range(per_rank):
            units = rng.randint(1, unit_cap)
            cost = rng.choice([10.0, 50.0]) if rng.random() < 0.2 else units * rng.lognormvariate(0, 1)
            candidates.append(Candidate(owner, index, units, cost, rng.randint(0, max_age)))
    return candidates


def check_assignment(bins: list[list[tuple[int, int]]], candidates: list[Candidate], ranks: int, micro_batches: int,
                     unit_cap: int, target: float, max_wait: int) -> None:
    """Every guarantee of ``fill_bins`` on one input/output pair."""
    by_key = {(c.owner, c.index): c for c in candidates}
    assert len(bins) == ranks * micro_batches
    placed = [key for contents in bins for key in contents]
    assert len(placed) == len(set(placed)) and set(placed) <= by_key.keys()  # nothing duplicated or invented
    loads, rooms = [], []
    for contents in bins:
        members = [by_key[key] for key in contents]
        load = sum(c.cost for c in members)
        loads.append(load)
        rooms.append(unit_cap - sum(c.units for c in members))
        assert rooms[-1] >= 0
        if load > target * (1 + 1e-9):  # over the target only through forced candidates or alone
            assert len(members) == 1 or all(c.age >= max_wait for c in members)
    if len(candidates) >= len(bins):
        assert all(bins)
    # Nothing left pending could still have gone into a bin: loads only grow and rooms only shrink,
    # so a bin that can take it now could when its turn came.
    for key in by_key.keys() - set(placed):
        c = by_key[key]
        limit = math.inf if c.age >= max_wait else target
        assert not any(room >= c.units and load + c.cost <= limit for load, room in zip(loads, rooms))
    forced = [c for c in candidates if c.age >= max_wait]
    if len(forced) <= len(bins):
        assert {(c.owner, c.index) for c in forced} <= set(placed)


@pytest.mark.parametrize("seed", range(60))
def test_random_windows_keep_every_guarantee(seed):
    rng = random.Random(seed)
    ranks, micro_batches = rng.randint(1, 4), rng.randint(1, 4)
    unit_cap, max_wait = rng.choice([1, 8, 100]), rng.randint(0, 4)
    candidates = random_window(rng, ranks, rng.randint(0, 25), unit_cap, max_wait + 1)
    target = rng.choice([20.0, 100.0, 1000.0])
    bins = fill_bins(candidates, ranks, micro_batches, unit_cap, target, max_wait)
    check_assignment(bins, candidates, ranks, micro_batches, unit_cap, target, max_wait)
    shuffled = candidates[:]
    rng.shuffle(shuffled)  # the order candidates are listed in must not matter
    assert fill_bins(shuffled, ranks, micro_batches, unit_cap, target, max_wait) == bins


def test_a_small_window_fills_by_decreasing_cost_into_the_least_loaded_bin():
    window = [Candidate(1, 0, 1, 6.0, 0), Candidate(0, 0, 1, 5.0, 0), Candidate(0, 1, 1, 4.0, 0),
              Candidate(1, 1, 1, 3.0, 0), Candidate(0, 2, 1, 2.5, 0)]
    # 6 -> rank 1 (all empty: its owner's bin), 5 -> rank 0, 4 -> rank 0 (9), 3 -> rank 1 (9), 2.5 fits nowhere
    assert fill_bins(window, 2, 1, 10, 10.0, 4) == [[(0, 0), (0, 1)], [(1, 0), (1, 1)]]


def test_equally_loaded_bins_prefer_the_owner_then_the_lowest_index():
    assert fill_bins([Candidate(1, 0, 1, 1.0, 0)], 2, 2, 10, 10.0, 4) == [[], [], [(1, 0)], []]
    equal = [Candidate(owner, index, 1, 1.0, 0) for owner in range(2) for index in range(2)]
    assert fill_bins(equal, 2, 2, 10, 10.0, 4) == [[(0, 0)], [(0, 1)], [(1, 0)], [(1, 1)]]


def test_equal_costs_go_oldest_first_then_by_owner_and_index():
    window = [Candidate(0, 0, 1, 8.0, 0), Candidate(1, 0, 1, 8.0, 2), Candidate(0, 1, 1, 8.0, 2)]
    assert fill_bins(window, 2, 1, 10, 10.0, 4) == [[(0, 1)], [(1, 0)]]


def test_all_forced_are_all_placed_whatever_the_target():
    window = [Candidate(owner, index, 1, 5.0 + index, 4) for owner in range(2) for index in range(10)]
    bins = fill_bins(window, 2, 2, 100, 1.0, 4)
    check_assignment(bins, window, 2, 2, 100, 1.0, 4)
    assert sorted(key for contents in bins for key in contents) == sorted((c.owner, c.index) for c in window)
    assert imbalance([sum(5.0 + index for _, index in contents) for contents in bins]) < 1.05  # still spread


def test_a_huge_candidate_waits_unless_forced_or_needed_and_then_sits_alone():
    small = [Candidate(0, index, 1, 1.0, 0) for index in range(20)]
    huge = Candidate(1, 0, 1, 1000.0, 0)
    bins = fill_bins([*small, huge], 2, 2, 100, 10.0, 4)
    assert (1, 0) not in {key for contents in bins for key in contents}  # enough cheap samples to fill every bin
    assert [len(contents) for contents in bins] == [5, 5, 5, 5]
    bins = fill_bins([*small[:3], huge], 2, 2, 100, 10.0, 4)  # otherwise a bin would stay empty
    assert [(1, 0)] in bins and all(bins)
    forced_huge = Candidate(1, 0, 1, 1000.0, 4)
    bins = fill_bins([*small, forced_huge], 2, 2, 100, 10.0, 4)
    assert bins[2] == [(1, 0)]  # its owner's first bin, alone: nothing else fits beside it
    check_assignment(bins, [*small, forced_huge], 2, 2, 100, 10.0, 4)


def test_fewer_candidates_than_bins_each_get_their_own():
    window = [Candidate(0, index, 5, 50.0 * (index + 1), 0) for index in range(3)]
    bins = fill_bins(window, 2, 4, 10, 10.0, 4)
    assert sorted(len(contents) for contents in bins) == [0] * 5 + [1] * 3
    check_assignment(bins, window, 2, 4, 10, 10.0, 4)
    assert fill_bins([], 3, 2, 10, 10.0, 4) == [[]] * 6


def test_the_units_cap_holds_when_cost_would_allow_more():
    window = [Candidate(0, index, 6, 0.1, age) for index, age in enumerate([0, 0, 5, 5, 0, 0])]
    bins = fill_bins(window, 1, 3, 10, 100.0, 4)
    assert [len(contents) for contents in bins] == [1, 1, 1]
    assert {(0, 2), (0, 3)} <= {key for contents in bins for key in contents}  # the forced ones go first


@pytest.mark.parametrize("bad", [
    Candidate(2, 0, 1, 1.0, 0),  # owner outside the group
    Candidate(0, 0, 11, 1.0, 0),  # over the units cap
    Candidate(0, 0, 0, 1.0, 0),
    Candidate(0, 0, 1, 0.0, 0),
    Candidate(0, 0, 1, math.nan, 0),
    Candidate(0, 0, 1, 1.0, -1),
    Candidate(1, 3, 1, 1.0, 0),  # the same (owner, index) as another
])
def test_invalid_candidates_are_refused(bad):
    with pytest.raises(ValueError):
        fill_bins([Candidate(1, 3, 1, 1.0, 0), bad], 2, 2, 10, 10.0, 4)


@pytest.mark.parametrize("arguments", [(0, 1, 10, 10.0, 4), (1, 0, 10, 10.0, 4), (1, 1, 10, 0.0, 4),
                                       (1, 1, 10, math.inf, 4), (1, 1, 10, 10.0, -1)])
def test_invalid_layouts_are_refused(arguments):
    with pytest.raises(ValueError):
        fill_bins([], *arguments)


def test_imbalance_and_per_rank_costs():
    assert imbalance([]) == imbalance([0.0, 0.0]) == imbalance([3.0, 3.0]) == 1.0
    assert imbalance([1.0, 3.0]) == 1.5
    assert per_rank_costs([1.0, 2.0, 3.0, 4.0, 5.0, 6.0], 2) == [3.0, 7.0, 11.0]
    with pytest.raises(ValueError):
        per_rank_costs([1.0, 2.0, 3.0], 2)


def test_streams_are_seeded_per_rank_and_respect_the_sequence_length():
    mix, costs = DataMix(), CostModel()
    first = list(islice(sample_stream(mix, costs, 0, 3), 2000))
    assert first == list(islice(sample_stream(mix, costs, 0, 3), 2000))
    assert first != list(islice(sample_stream(mix, costs, 0, 4), 2000))
    assert all(0 < s.units <= mix.max_seq_len and s.cost > 0 for s in first)
    assert any(s.units == mix.max_seq_len for s in first)  # the long tail is chunked
    assert any(s != costs.sample(s.units) for s in first)  # some samples carry images


def test_grouped_filling_balances_ranks_that_token_packing_does_not():
    config = SimConfig(ranks=64, group_size=8, steps=4, warmup_steps=2, seed=1)
    results = simulate(config)
    tokens, cost_fill, grouped = results["tokens"], results["cost-fill"], results["grouped"]
    assert mean(tokens.imbalance) > 1.15 and mean(tokens.sync) > 1.15
    assert max(grouped.imbalance) <= 1.05 and max(grouped.sync) <= 1.05
    assert mean(grouped.imbalance) <= mean(cost_fill.imbalance) < mean(tokens.imbalance)
    assert 0.9 < mean(grouped.fill) <= 1.0 + 1e-9
    assert max(grouped.waits) <= config.max_wait and max(cost_fill.waits) <= config.max_wait  # nothing starves
    assert grouped.placed > 0 and cost_fill.moved == 0


def test_simulate_refuses_unknown_policies_and_empty_runs():
    with pytest.raises(ValueError):
        simulate(SimConfig(ranks=8), policies=("bogus",))
    with pytest.raises(ValueError):
        simulate(SimConfig(ranks=8, steps=0))
