"""Balanced encoder work (``parallel.encoder_balance``, veomni/parallel/media/colocate.py): the tiny VLM
with its images spread over the ranks by encoder cost trains exactly like one process, on steps
where a rank has no image, where one image is much larger than the others, where one rank holds
most of the images and where no rank has any; the skewed step's encoder work ends up even; and
the pure assignment is deterministic, owner-preferring and complete."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from harness.gloo_ranks import run_distributed
from harness.media_bytes import png_bytes
from models.audio.config import AudioEncoderConfig
from models.audio.processing import encode_wav
from models.omni.modality_registry import get_modality
from models.vit.config import ViTConfig
from tests.media_parity import image, run_media_steps, text
from tests.omni_utils import TINY_OMNI
from tests.parity_utils import assert_records_close
from veomni.config.schema import ParallelConfig
from veomni.contract import build_model
from veomni.contract.media import collate_items
from veomni.parallel.media.assign import assign_items
from veomni.parallel.media.colocate import check_media_routing

SKEWED_STEP = 2


def global_steps() -> list[list[dict]]:
    """Step -> samples; rank r of N takes samples r, r + N, ... At 2 ranks: step 0, rank 1 has no
    image; step 1, one 84x84 image (36 patches, 81x the attention of a 28x28 one) among 28x28
    images; step 2, rank 0 holds seven images of mixed sizes and rank 1 one small one (encoder
    FLOPs 1.92x the mean on rank 0); step 3, no image at all."""
    return [
        [image(0), text(1), image(2), text(3), image(4), text(5)],
        [image(6, 84), image(7, 28), image(8, 28), image(9, 28), image(10, 28), image(11, 28)],
        [image(12, 84, 56), text(13), image(14, 56), text(15), image(16, 56), image(17, 28), image(18, 84, 28),
         text(19), image(20, 56, 28), text(21), image(22, 56, 28), text(23), image(24, 28), text(25)],
        [text(26), text(27), text(28), text(29)],
    ]


@pytest.fixture(scope="module")
def reference() -> dict:
    return run_distributed(run_media_steps, 1, ParallelConfig(), global_steps())[0]


@pytest.fixture(scope="module")
def balanced_two_ranks() -> list[dict]:
    return run_distributed(run_media_steps, 2, ParallelConfig(encoder_balance=True), global_steps())


def test_balanced_encoders_match_one_process_at_two_ranks(reference, balanced_two_ranks):
    owned = [r["owned"] for r in balanced_two_ranks]
    assert owned[1][0] == 0 and owned[0][3] == owned[1][3] == 0  # step 0: rank 1 without image; step 3: none
    assert balanced_two_ranks[1]["encoded"][0] > 0  # ... yet rank 1 encodes some of rank 0's images
    for got in balanced_two_ranks:
        assert_records_close(reference, got)


def test_skewed_step_is_balanced(balanced_two_ranks):
    def imbalance(costs: list[float]) -> float:
        return max(costs) / (sum(costs) / len(costs))

    owned = [r["owned"][SKEWED_STEP] for r in balanced_two_ranks]
    encoded = [r["encoded"][SKEWED_STEP] for r in balanced_two_ranks]
    assert sum(encoded) == pytest.approx(sum(owned))  # every image encoded once
    assert imbalance(owned) > 1.6
    assert imbalance(encoded) <= 1.1


def test_balanced_encoders_match_one_process_at_four_ranks(reference):
    results = run_distributed(run_media_steps, 4, ParallelConfig(encoder_balance=True), global_steps())
    assert [r["owned"][0] == 0 for r in results] == [False, True, False, True]
    for got in results:
        assert_records_close(reference, got)


def test_assignment_is_deterministic_complete_and_prefers_owners():
    costs = [[9.0, 1.0, 7.0, 3.0, 3.0, 5.0], [2.0], [], [4.0, 4.0]]
    runner = assign_items(costs)
    assert runner == assign_items(costs)
    assert [len(r) for r in runner] == [len(c) for c in costs]
    assert all(0 <= r < len(costs) for owned in runner for r in owned)
    loads = [sum(c for owned, ranks in zip(costs, runner) for c, r in zip(owned, ranks) if r == rank)
             for rank in range(len(costs))]
    assert runner == [[0, 3, 1, 2, 1, 2], [2], [], [3, 3]]  # the empty rank 2 takes work first
    assert loads == [9.0, 10.0, 10.0, 9.0]  # 38 over 4 ranks: the best split is 10/10/9/9
    assert assign_items([[5.0, 5.0], [5.0, 5.0]]) == [[0, 0], [1, 1]]  # already even: nothing moves
    assert assign_items([[100.0, 1.0, 1.0], [1.0]]) == [[0, 1, 1], [1]]  # the big one stays home
    assert assign_items([[], []]) == [[], []]


def test_encoder_balance_is_refused_where_it_cannot_apply():
    with torch.device("meta"):
        _, omni = build_model("omni", TINY_OMNI)
        _, llm = build_model("llm", TINY_OMNI["llm"])
    assert check_media_routing(omni, ParallelConfig(encoder_balance=True)) == []
    assert check_media_routing(llm, ParallelConfig()) == []
    assert "runs no media encoders" in check_media_routing(llm, ParallelConfig(encoder_balance=True))[0]
    assert check_media_routing(omni, ParallelConfig(encoder_balance=True, sp=2)) == []  # test_media_sp.py
    assert "parallel.cp=2" in check_media_routing(omni, ParallelConfig(encoder_balance=True, cp=2))[0]
    assert check_media_routing(omni, ParallelConfig(encoder_balance=True, pp=2)) == []  # test_media_pp.py
    inline = ParallelConfig(encoder_balance=True, pp=2, encoder_colocate=False)
    assert "parallel.pp=2 and parallel.encoder_colocate=false" in check_media_routing(omni, inline)[0]


def _wav(seconds: float) -> bytes:
    return encode_wav(0.5 * np.sin(2 * np.pi * 440 * np.arange(int(seconds * 16000)) / 16000), 16000)


@pytest.mark.parametrize("name, config, raw", [
    ("image", ViTConfig(**TINY_OMNI["encoders"]["image"]), [png_bytes(1, 84, 56), png_bytes(2, 28), png_bytes(3)]),
    ("audio", AudioEncoderConfig(n_mels=16, hidden_size=32, num_heads=4, intermediate_size=64, out_hidden_size=32),
     [_wav(0.5), _wav(0.33), _wav(0.1)]),
], ids=["image", "audio"])
def test_split_inverts_collation(name, config, raw):
    """What balancing moves between ranks: the items the processor made, with their feature rows."""
    modality = get_modality(name)
    items = [modality.processor(r, config) for r in raw]
    pieces = modality.split(collate_items(items), config)
    assert [p.num_tokens for p in pieces] == [i.num_tokens for i in items]
    assert [p.cost for p in pieces] == [i.cost for i in items]
    for piece, item in zip(pieces, items):
        assert piece.inputs.keys() == item.inputs.keys()
        for key in item.inputs:
            torch.testing.assert_close(piece.inputs[key], item.inputs[key], rtol=0, atol=0)
