"""Long-short sequence parallelism for encoders (``parallel.encoder_sp``, routed by
``veomni/parallel/media/route.py``): a long image (or audio clip) runs over a block of ranks, each
holding a share of its rows, while short items run whole on one rank in the same step; the tiny
VLM then trains exactly like one process, alone and combined with balancing and LLM sequence
parallelism, at 2 and 4 gloo ranks, including a step where a rank has no image and a step with
no image at all; the audio model too. The pure placement rules are checked on their own."""

from __future__ import annotations

import pytest

from harness.gloo_ranks import run_distributed
from tests.media_parity import run_media_steps
from tests.models.test_audio_modality import ENCODERS
from tests.parallel.test_media_sp import BIG, SPANNING_STEP, audio_steps, sp_steps
from tests.parity_utils import assert_records_close
from veomni.config.schema import ParallelConfig
from veomni.parallel.media.assign import assign_items, assign_work, block_chunks

pytestmark = pytest.mark.full  # whole runs / multi-rank trainers: the full tier (tests/conftest.py)

THRESHOLD = 32  # patches: the 168x168 image (144) and the 84x56 one (24) -> only the first is long


@pytest.fixture(scope="module")
def reference() -> dict:
    return run_distributed(run_media_steps, 1, ParallelConfig(), sp_steps(), BIG)[0]


@pytest.mark.parametrize("world, extra", [
    (2, {}), (2, {"encoder_balance": True}), (4, {}), (4, {"encoder_balance": True, "sp": 2}),
], ids=["dp2", "dp2-balanced", "dp4", "dp2xsp2-balanced"])
def test_long_items_run_sequence_parallel_and_match_one_process(reference, world, extra):
    parallel = ParallelConfig(encoder_sp=2, encoder_sp_threshold=THRESHOLD, **extra)
    results = run_distributed(run_media_steps, world, parallel, sp_steps(), BIG)
    for got in results:
        assert_records_close(reference, got)
    shared = [r["shared"][SPANNING_STEP] for r in results]
    assert sum(shared) == 144 and sorted(shared)[-2:] == [72, 72]  # the big image: 2 x 18 merge groups
    assert all(r["shared"][step] == 0 for r in results for step in range(len(sp_steps())) if step != SPANNING_STEP)


def test_long_audio_clip_runs_sequence_parallel_and_matches_one_process():
    overrides = {"encoders": ENCODERS}
    parallel = ParallelConfig(encoder_sp=2, encoder_sp_threshold=20, encoder_balance=True)
    reference = run_distributed(run_media_steps, 1, ParallelConfig(), audio_steps(), overrides)[0]
    for got in run_distributed(run_media_steps, 2, parallel, audio_steps(), overrides):
        assert_records_close(reference, got)


def test_long_items_take_the_least_loaded_block_and_short_ones_fill_around():
    costs = [[8.0, 1.0, 1.0], [6.0], [], [1.0]]
    long = [[True, False, False], [True], [], [False]]
    balanced = assign_work(costs, long, 2, balance=True)
    assert balanced == [[(0, 1), (2,), (0,)], [(2, 3)], [], [(3,)]]  # 8 -> block 0 (4 each), 6 -> block 1 (3 each)
    assert assign_work(costs, long, 2, balance=False) == [[(0, 1), (0,), (0,)], [(2, 3)], [], [(3,)]]
    assert assign_work([[1.0], [1.0]], [[False], [False]], 2, balance=True) == [[(0,)], [(1,)]]
    with pytest.raises(ValueError, match="do not tile"):
        assign_work([[1.0]] * 3, [[True]] * 3, 2, balance=False)


def test_block_chunks_split_the_pack_like_the_encoder():
    assert block_chunks([36], 2) == [[18, 18]]
    assert block_chunks([5, 4], 2) == [[5, 0], [0, 4]]
    assert block_chunks([3, 2], 4) == [[2, 1, 0, 0], [0, 1, 1, 0]]  # ceil(5/4) = 2 rows per member
    assert block_chunks([], 2) == []


def test_assignment_never_worse_than_leaving_items_home():
    owned = [[3.0, 3.0], [2.0, 2.0, 2.0]]  # 6 / 6 already; longest-first alone would give 5 / 7
    assert assign_items(owned) == [[0, 0], [1, 1, 1]]


def test_placement_fills_around_work_the_ranks_already_have():
    """A pipeline's stages: the rank already carrying 10 units of its own takes no item until the
    other has caught up."""
    assert assign_items([[4.0, 3.0, 2.0], []], loads=[0.0, 10.0]) == [[0, 0, 0], []]
    assert assign_items([[4.0, 3.0, 2.0], []], loads=[0.0, 3.0]) == [[0, 1, 0], []]
    assert assign_work([[6.0, 1.0], [], [], []], [[True, False], [], [], []], 2, balance=True,
                       loads=[5.0, 5.0, 0.0, 0.0]) == [[(2, 3), (2,)], [], [], []]
