"""Omni models under LLM sequence parallelism (``parallel.sp``): the ranks holding a row split its
media items by encoder cost and each receives exactly the features of the placeholders in its
slice (``veomni/parallel/media/colocate.py``, ``veomni.tasks.vlm.localize_media``). The tiny VLM trains
like one process at sp=2 and dp=2 x sp=2, with and without ``parallel.encoder_balance``, on steps
where a slice (or a whole row) has no image, where one large image spans the slice boundary, with
many mixed images, and with no image at all; every image is encoded exactly once; the audio model
does the same at sp=2."""

from __future__ import annotations

import pytest
import torch

from harness.gloo_ranks import run_distributed
from tests.media_parity import image, run_media_steps, text
from tests.models.test_audio_modality import ENCODERS, audio_record
from tests.omni_utils import TINY_OMNI, TOKENIZER, tiny_omni
from tests.parity_utils import assert_records_close
from veomni.config.schema import ParallelConfig
from veomni.contract import build_model
from veomni.data.chat.media_dataset import SampleProcessor, pack_chat_samples
from veomni.data.text.packed import load_tokenizer
from veomni.parallel.row_split import RowSplit, shard_batch
from veomni.parallel.sequence import check_sequence_parallel
from veomni.tasks.vlm import VLM_CONTRACT

BIG = {"encoders": {"image": {**TINY_OMNI["encoders"]["image"], "max_pixels": 168 * 168}}}
SPANNING_STEP, MIXED_STEP, EMPTY_STEP = 1, 2, 3


def sp_steps() -> list[list[dict]]:
    """Step 0: one image, in the first slice only (at dp=2 the other row has none); step 1: a
    168x168 image (144 patches) across the slice boundary next to a small one; step 2: seven
    images of mixed sizes; step 3: no image."""
    return [
        [image(0), text(1), text(2), text(3), text(4), text(5)],
        [text(6), text(8), text(10), image(7, 168), image(9, 28), text(11)],
        [image(12, 84, 56), image(13, 28), image(14, 56), text(15), image(16, 56), image(17, 28), image(18, 84, 28),
         image(19, 28)],
        [text(20), text(21), text(22), text(23)],
    ]


def _slices(samples: list[dict], dp: int, overrides: dict) -> list[list[dict]]:
    """Each data-parallel row's two sequence-parallel slices of ``samples``."""
    config, _ = tiny_omni(**overrides)
    process = SampleProcessor(load_tokenizer(str(TOKENIZER)), config)
    rows = [pack_chat_samples([process(r) for r in samples[d::dp]]) for d in range(dp)]
    return [[shard_batch(row, RowSplit(sp_rank=r, sp=2), VLM_CONTRACT) for r in range(2)] for row in rows]


@pytest.mark.parametrize("dp", [1, 2])
def test_slices_get_their_placeholders_at_local_positions(dp):
    """What the steps exercise, and the sharding itself: each slice's positions are exactly its
    image placeholder tokens, and ``holders`` splits the row's feature rows between the slices."""
    config, _ = tiny_omni(**BIG)
    placeholder = SampleProcessor(load_tokenizer(str(TOKENIZER)), config).chat.token_of["<image>"]
    holders_per_step = []
    for samples in sp_steps():
        step = []
        for row in _slices(samples, dp, BIG):
            entries = [s["media"].get("image") for s in row]
            if entries[0] is None:
                step.append(None)
                continue
            for rank, (slice_, entry) in enumerate(zip(row, entries)):
                assert (slice_["input_ids"] == placeholder).sum() == entry["positions"].numel()
                assert (slice_["input_ids"][entry["positions"]] == placeholder).all()
                assert entry["positions"].numel() == int((entry["holders"] == rank).sum())
            step.append(entries[0]["holders"])
        holders_per_step.append(step)
    assert any(h is not None and set(h.tolist()) == {0} for h in holders_per_step[0])  # a slice without image
    assert all(h is None for h in holders_per_step[EMPTY_STEP])
    image_rows = 37 if dp == 1 else 36  # the big image's 36 features (+ the small one's when it shares the row)
    spanning = [h for h in holders_per_step[SPANNING_STEP] if h is not None and h.numel() == image_rows]
    assert len(spanning) == 1 and set(spanning[0][:36].tolist()) == {0, 1}  # across the slice boundary


@pytest.fixture(scope="module")
def reference() -> dict:
    return run_distributed(run_media_steps, 1, ParallelConfig(), sp_steps(), BIG)[0]


@pytest.mark.parametrize("world, balance", [(2, False), (2, True), (4, False), (4, True)],
                         ids=["sp2", "sp2-balanced", "dp2xsp2", "dp2xsp2-balanced"])
def test_sequence_parallel_media_match_one_process(reference, world, balance):
    results = run_distributed(run_media_steps, world, ParallelConfig(sp=2, encoder_balance=balance), sp_steps(), BIG)
    for got in results:
        assert_records_close(reference, got)
    for step in range(len(sp_steps())):  # each row's images are owned by both its ranks, encoded once
        encoded = sum(r["encoded"][step] for r in results)
        assert encoded == pytest.approx(sum(r["owned"][step] for r in results) / 2)
    assert all(r["encoded"][MIXED_STEP] > 0 for r in results)  # every rank encodes a share


def audio_steps() -> list[list[dict]]:
    return [
        [audio_record("a0", "A low tone.", 0.5, 1), text(1), image(2), audio_record("a3", "A high tone.", 1.2, 2),
         text(4), image(5, 56)],
        [text(6), audio_record("a7", "A short beep.", 0.2, 3), text(8)],
        [text(9), text(10)],
    ]


def test_audio_model_under_sequence_parallelism_matches_one_process():
    overrides = {"encoders": ENCODERS}
    reference = run_distributed(run_media_steps, 1, ParallelConfig(), audio_steps(), overrides)[0]
    for got in run_distributed(run_media_steps, 2, ParallelConfig(sp=2), audio_steps(), overrides):
        assert_records_close(reference, got)


def test_sequence_parallelism_is_accepted_for_omni_models_and_context_parallelism_refused():
    with torch.device("meta"):
        _, omni = build_model("omni", TINY_OMNI)
    assert check_sequence_parallel(omni, 2) == []
    assert "context parallelism is not supported for models with encoders" in check_sequence_parallel(omni, 1, 2)[0]
