"""The ``qwen2_5_vl`` family fed by the chat loader (Qwen's layout: vision start/end tokens, 2-frame
temporal patches, M-RoPE positions [T, 3]) under the media parallelisms: pipeline parallelism at
pp=2 (encoders colocated on both ranks, and inline in the first stage) and balanced encoder work
(``parallel.encoder_balance``) at 2 ranks train exactly like one process (fp32, SGD: losses, every
gradient, every updated parameter); long-short sequence parallelism of a windowed tower is refused
before any worker starts, with the reason."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch

from harness.gloo_ranks import run_distributed
from tests.launch.test_launch import REPO
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
    sizes, which Qwen's resize rounds to multiples of 28)."""
    return [
        [image(0), text(1), image(2), text(3), image(4), text(5), image(6, 45), text(7)],
        [image(8, 84), image(9, 28), image(10, 37), image(11, 28)],
    ]


@pytest.fixture(scope="module")
def reference() -> dict:
    return run_distributed(_reference, 1, TINY_QWEN_VL_CHAT, steps(), ARCH)[0]


@pytest.mark.parametrize("colocate", [True, False], ids=["colocated", "inline"])
def test_pp2_matches_one_process(reference, colocate):
    parallel = ParallelConfig(pp=2, pp_schedule="1F1B", encoder_colocate=colocate)
    records = run_distributed(_pipelined, 2, parallel, TINY_QWEN_VL_CHAT, steps(), False, ARCH)
    check(reference, records)
    if colocate:
        check_spread(records)


def test_balanced_encoders_match_one_process():
    one = run_distributed(run_media_steps, 1, ParallelConfig(), steps(), None, ARCH)[0]
    two = run_distributed(run_media_steps, 2, ParallelConfig(encoder_balance=True), steps(), None, ARCH)
    assert two[0]["owned"][0] > 0 and two[1]["owned"][0] == 0  # step 0: rank 1's row has no image ...
    assert two[1]["encoded"][0] > 0  # ... yet it encodes some of rank 0's
    for got in two:
        assert_records_close(one, got)


def test_encoder_sp_over_a_windowed_tower_is_refused_before_workers_start(tmp_path):
    with torch.device("meta"):
        _, model = build_model(ARCH, TINY_QWEN_VL_CHAT)
    problems = check_media_routing(model, ParallelConfig(encoder_sp=2, encoder_sp_threshold=64))
    assert len(problems) == 1 and "attention windows (window_size=56)" in problems[0]
    result = subprocess.run(
        [sys.executable, "-m", "veomni.launch", str(REPO / "recipes" / "qwen2.5-vl" / "tiny.yaml"), "--dry-run",
         "--world-size", "2", "--parallel.encoder_sp", "2", "--train.output_dir", str(tmp_path / "out"),
         "--checkpoint.init_from_hf", str(tmp_path / "absent")],
        cwd=REPO, capture_output=True, text=True, timeout=300)
    assert result.returncode == 2, result.stdout + result.stderr
    assert "encoder encoders.image has attention windows (window_size=112)" in result.stderr
