"""The ``qwen2_5_vl`` family fed by the chat loader (Qwen's layout: vision start/end tokens, 2-frame
temporal patches, M-RoPE positions [T, 3]) under the media parallelisms: pipeline parallelism at
pp=2 (encoders colocated on both ranks, and inline in the first stage) and at pp=2 x dp=2 (alone,
with the tower's own 2-way FSDP group, ``parallel.encoder_fsdp``, and with long images
sequence-parallel), the tower replicated beside the LLM's FSDP (``encoder_fsdp=1``), balanced
encoder work (``parallel.encoder_balance``) and long-short sequence parallelism of the windowed
tower (``parallel.encoder_sp``: shares cut in window order, features put back in input order) at 2
ranks train exactly like one process (fp32, SGD: losses, every gradient, every updated parameter)."""

from __future__ import annotations

import pytest
import torch

from harness.gloo_ranks import run_distributed
from tests.media_parity import image, run_media_steps, text
from tests.omni_utils import TINY_QWEN_VL_CHAT
from tests.parallel.test_media_pp import _pipelined, _reference, check, check_spread
from tests.parity_utils import assert_records_close
from veomni.config.schema import ParallelConfig
from veomni.contract import build_model
from veomni.parallel.media.colocate import check_media_routing

pytestmark = pytest.mark.full  # multi-rank trainers: the full tier (tests/conftest.py)

ARCH = "qwen2_5_vl"


def steps() -> list[list[dict]]:
    """Rank r of 2 takes samples r, r + 2, ...; in the pipeline, micro-batch i the i-th half of those.
    Step 0: data-parallel rank 1 has no image; step 1: one 84x84 image among 28x28 ones (and odd
    sizes, which Qwen's resize rounds to multiples of 28); step 2: one 84 wide x 56 high image (2 x 3
    merged tokens, a window of 2 x 2 and a partial one) and a 28x28 one, rank 1 text only."""
    return [
        [image(0), text(1), image(2), text(3), image(4), text(5), image(6, 45), text(7)],
        [image(8, 84), image(9, 28), image(10, 37), image(11, 28)],
        [image(12, 84, 56), text(13), image(14, 28), text(15)],
    ]


@pytest.fixture(scope="module")
def reference() -> dict:
    return run_distributed(_reference, 1, TINY_QWEN_VL_CHAT, steps(), ARCH)[0]


@pytest.fixture(scope="module")
def one_process() -> dict:
    return run_distributed(run_media_steps, 1, ParallelConfig(), steps(), None, ARCH)[0]


@pytest.mark.parametrize("colocate", [True, False], ids=["colocated", "inline"])
def test_pp2_matches_one_process(reference, colocate):
    parallel = ParallelConfig(pp=2, pp_schedule="1F1B", encoder_colocate=colocate)
    records = run_distributed(_pipelined, 2, parallel, TINY_QWEN_VL_CHAT, steps(), False, ARCH)
    check(reference, records)
    if colocate:
        check_spread(records)


@pytest.mark.parametrize("extra", [{}, {"encoder_fsdp": 2}, {"encoder_sp": 2, "encoder_sp_threshold": 16}],
                         ids=["plain", "encoder-fsdp2", "encoder-sp2"])
def test_pp2_x_dp2_matches_one_process(reference, extra):
    """Data-parallel rank 1 has no image in steps 0 and 2; with encoder_sp every image over 16
    patches (4x6 and 6x6 ones in step 0, 6x6 in step 1, 4x6 in step 2) runs over a block of 2 ranks."""
    parallel = ParallelConfig(pp=2, pp_schedule="1F1B", **extra)
    records = run_distributed(_pipelined, 4, parallel, TINY_QWEN_VL_CHAT, steps(), False, ARCH)
    check(reference, records)
    if "encoder_sp" in extra:
        assert [sum(r["shared"][step] for r in records) for step in range(3)] == [60, 36, 24]
    else:
        check_spread(records)


def test_replicated_encoder_matches_one_process(one_process):
    for got in run_distributed(run_media_steps, 2, ParallelConfig(encoder_fsdp=1), steps(), None, ARCH):
        assert_records_close(one_process, got)


def test_balanced_encoders_match_one_process(one_process):
    two = run_distributed(run_media_steps, 2, ParallelConfig(encoder_balance=True), steps(), None, ARCH)
    assert two[0]["owned"][0] > 0 and two[1]["owned"][0] == 0  # step 0: rank 1's row has no image ...
    assert two[1]["encoded"][0] > 0  # ... yet it encodes some of rank 0's
    for got in two:
        assert_records_close(one_process, got)


def test_windowed_encoder_sp_matches_one_process(one_process):
    """Images over 16 patches run over both ranks: step 0 the 4x6- and 6x6-patch ones packed, step 1
    the 6x6 one, step 2 the 4x6 one alone, whose shares (3 merged tokens each, in window order) each
    hold features the other rank returns."""
    parallel = ParallelConfig(encoder_sp=2, encoder_sp_threshold=16)
    with torch.device("meta"):
        assert check_media_routing(build_model(ARCH, TINY_QWEN_VL_CHAT)[1], parallel) == []
    two = run_distributed(run_media_steps, 2, parallel, steps(), None, ARCH)
    assert [[r["shared"][step] for r in two] for step in range(3)] == [[32, 28], [20, 16], [12, 12]]
    for got in two:
        assert_records_close(one_process, got)
