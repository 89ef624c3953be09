"""Long-short sequence parallelism for encoders (veomni/parallel/media/encoder_sp.py): one long item run
over a group of 2 or 4 gloo ranks, each on a share of its rows, gives the one-process features
(chunks concatenated in rank order) and encoder weight gradients (summed over the group), in
fp32: for a large image whose merge groups do not divide evenly (padding), a video, two packed
images, a long audio clip and Qwen2.5-VL's windowed tower (shares cut in window order, features
put back in input order), also under activation checkpointing and with two groups running
different items at once. The split, the model-side share checks and the launcher check are
tested on their own."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import MixedPrecisionPolicy

from harness.gloo_ranks import run_distributed
from tests.omni_utils import TINY_OMNI
from tests.parity_utils import assert_grads_parity, assert_parity, full_grads
from veomni.config.schema import ParallelConfig
from veomni.contract import build_model
from veomni.contract.plan import flatten_plan
from veomni.ops.attention import RowShare
from veomni.parallel.activation_checkpoint import apply_activation_checkpointing
from veomni.parallel.fsdp import apply_fsdp
from veomni.parallel.media.encoder_sp import (
    _into_input_order,
    apply_encoder_sp,
    check_encoder_sp,
    is_long_item,
    item_shares,
    run_encoder_share,
    split_rows,
)
from veomni.parallel.mesh import LayoutError, ParallelDims

TINY_IMAGE = TINY_OMNI["encoders"]["image"]  # 2 heads: groups of 2 ranks
IMAGE_4_HEADS = {**TINY_IMAGE, "num_heads": 4}  # head_dim 8, for groups of 4
# Qwen2.5-VL's tower: windows of 2 x 2 merged tokens (56 px), full attention in layer 1
WINDOWED = {**IMAGE_4_HEADS, "norm": "rmsnorm", "mlp": "gated", "window_size": 56, "full_attention_layers": [1]}
TINY_AUDIO = dict(n_mels=16, hidden_size=32, num_layers=2, num_heads=4, intermediate_size=64, out_hidden_size=32)
PATCH_DIM = 3 * 14 * 14


def _images(*grids: tuple[int, int, int]) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(sum(map(sum, grids)))
    patches = sum(t * h * w for t, h, w in grids)
    return {"patches": torch.randn(patches, PATCH_DIM, generator=gen),
            "grid_thw": torch.tensor(grids, dtype=torch.long)}


def _audio(frames: int) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(frames)
    return {"features": torch.randn(frames, TINY_AUDIO["n_mels"], generator=gen),
            "lengths": torch.tensor([frames], dtype=torch.long)}


# name -> (modality, encoder config, inputs)
CASES = {
    # 140 patches = 35 merge groups: 2 ranks hold 18 + 17 groups, 4 ranks 9 + 9 + 9 + 8 (padding)
    "large_image": ("image", TINY_IMAGE, _images((1, 10, 14))),
    "large_image_4_heads": ("image", IMAGE_4_HEADS, _images((1, 10, 14))),
    # 3 frames of 24 patches (18 groups): shares cut across frame boundaries
    "video": ("image", IMAGE_4_HEADS, _images((3, 4, 6))),
    "two_images": ("image", TINY_IMAGE, _images((1, 6, 4), (1, 4, 8))),
    # a short image, a long one of 5 x 7 merged tokens (partial windows at the right and bottom) and a
    # 2-frame video packed: 6 + 35 + 12 features, 27 + 26 at 2 ranks, 14 + 14 + 14 + 11 at 4; the
    # share edges cut through rows of windows, so some features are made by another member
    "windowed": ("image", WINDOWED, _images((1, 4, 6), (1, 10, 14), (2, 6, 4))),
    # 290 frames -> 73 tokens: 37 + 36 at 2 ranks, 19 + 19 + 19 + 16 at 4
    "long_audio": ("audio", TINY_AUDIO, _audio(290)),
}


def _encoder(case: str) -> tuple[torch.nn.Module, torch.nn.Module]:
    """(the omni model, its encoder for ``case``) with weights fixed by the seed."""
    modality, config, _ = CASES[case]
    torch.manual_seed(0)
    _, model = build_model("omni", {**TINY_OMNI, "encoders": {modality: config}})
    model.init_weights()
    return model, model.encoders[modality]


def _probe(rows: int, width: int) -> torch.Tensor:
    """Fixed weights of a loss that is a sum over feature rows: ``(features * probe).sum()``."""
    return torch.randn(rows, width, generator=torch.Generator().manual_seed(7))


def _reference(case: str) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    _, encoder = _encoder(case)
    features = encoder(**CASES[case][2])
    (features * _probe(*features.shape)).sum().backward()
    return features.detach(), full_grads(encoder)


def _sharded(rank: int, world: int, groups: list[list[int]], cases: list[str], checkpointed: bool = False,
             fsdp: bool = False) -> dict:
    """Run ``cases[i]`` on the ranks ``groups[i]``; every group is made on every rank. ``fsdp``:
    the encoder sharded over all ranks (its gradients come back averaged: summing the ranks'
    copies gives the sum again)."""
    handles = [dist.new_group(ranks) for ranks in groups]
    mine = next(i for i, ranks in enumerate(groups) if rank in ranks)
    case, group = cases[mine], handles[mine]
    model, encoder = _encoder(case)
    apply_encoder_sp(model)
    if checkpointed:
        apply_activation_checkpointing(model, flatten_plan(model.parallel_plan()), "full")
    if fsdp:
        apply_fsdp(encoder, encoder.parallel_plan(), init_device_mesh("cpu", (world,)), MixedPrecisionPolicy())
    inputs = CASES[case][2]
    features = run_encoder_share(group, encoder, inputs)
    counts = item_shares(encoder, inputs, len(groups[mine])).feature_rows()
    start = sum(counts[:dist.get_rank(group)])
    probe = _probe(sum(counts), features.shape[1])[start:start + features.shape[0]]
    (features * probe).sum().backward()
    return {"case": case, "features": features.detach(), "grads": full_grads(encoder)}


def _assert_matches_reference(results: list[dict], case: str) -> None:
    features, grads = _reference(case)
    assert_parity(torch.cat([r["features"] for r in results]), features, f"{case}: features")
    summed = {name: sum(r["grads"][name] for r in results) for name in results[0]["grads"]}
    assert_grads_parity(summed, grads, case)


@pytest.mark.parametrize("case, ranks", [
    ("large_image", 2), ("large_image_4_heads", 4), ("video", 2), ("video", 4), ("two_images", 2),
    ("long_audio", 2), ("long_audio", 4), ("windowed", 2), ("windowed", 4),
])
def test_sharded_encoder_matches_one_process(case, ranks):
    results = run_distributed(_sharded, ranks, [list(range(ranks))], [case])
    shares = item_shares(_encoder(case)[1], CASES[case][2], ranks)
    assert [r["features"].shape[0] for r in results] == shares.feature_rows()
    _assert_matches_reference(results, case)


def test_padding_is_exercised():
    """The parity cases above include uneven shares (padding past the sequence's end)."""
    _, image = _encoder("large_image")
    _, audio = _encoder("long_audio")
    assert item_shares(image, CASES["large_image"][2], 2).feature_rows() == [18, 17]
    assert item_shares(image, CASES["large_image"][2], 4).feature_rows() == [9, 9, 9, 8]
    assert item_shares(audio, CASES["long_audio"][2], 4).feature_rows() == [19, 19, 19, 16]


@pytest.mark.parametrize("case", ["large_image", "windowed"])
def test_sharded_encoder_under_activation_checkpointing(case):
    """Recomputation in the backward pass replays the share with the block's arguments."""
    results = run_distributed(_sharded, 2, [[0, 1]], [case], True)
    _assert_matches_reference(results, case)


@pytest.mark.parametrize("ranks", [2, 4])
def test_windowed_shares_are_cut_in_window_order(ranks):
    """The windowed case's members make features that other members return (so the exchange back
    into input order is exercised), and a share order that is not a permutation is refused."""
    _, encoder = _encoder("windowed")
    inputs = CASES["windowed"][2]
    order = encoder.share_order(inputs)
    shares = item_shares(encoder, inputs, ranks)
    chunk = shares.chunk // shares.rows_per_feature
    assert sorted(order.tolist()) == list(range(53)) and not torch.equal(order, torch.arange(53))
    assert any((order[r * chunk:(r + 1) * chunk] // chunk != r).any() for r in range(ranks))
    assert _encoder("large_image")[1].share_order(inputs) is None  # no windows: input order
    with pytest.raises(ValueError, match="permutation of the 53 features"):
        _into_input_order(None, torch.zeros(27, 32), order.clamp(max=40), shares)


def test_sharded_encoder_under_fsdp():
    """The encoder's weights FSDP-sharded over the group, as in training."""
    results = run_distributed(_sharded, 2, [[0, 1]], ["video"], False, True)
    _assert_matches_reference(results, "video")


def test_two_groups_run_different_items_at_once():
    results = run_distributed(_sharded, 4, [[0, 2], [1, 3]], ["large_image", "long_audio"])
    _assert_matches_reference([results[0], results[2]], "large_image")
    _assert_matches_reference([results[1], results[3]], "long_audio")


def _without_installation(rank: int, world: int) -> None:
    _, encoder = _encoder("large_image")
    run_encoder_share(dist.group.WORLD, encoder, CASES["large_image"][2])


def test_share_without_installed_attention_is_refused():
    with pytest.raises(AssertionError, match="no attn_fn that gathers"):
        run_distributed(_without_installation, 2)


def test_split_rows():
    shares = split_rows(140, 4, 4)
    assert [shares.held(r) for r in range(4)] == [(0, 36), (36, 72), (72, 108), (108, 140)]
    assert shares.chunk == 36 and shares.feature_rows() == [9, 9, 9, 8]
    even = split_rows(64, 4, 2)
    assert [even.held(r) for r in range(2)] == [(0, 32), (32, 64)] and even.feature_rows() == [8, 8]
    # 5 groups over 4 ranks: 2 + 2 + 1 + 0; the empty rank still joins the all-to-alls (pure padding)
    sparse = split_rows(20, 4, 4)
    assert sparse.feature_rows() == [2, 2, 1, 0] and sparse.held(3) == (20, 20)
    assert split_rows(7, 1, 1).held(0) == (0, 7)
    with pytest.raises(ValueError, match="cannot be split over 4 ranks"):
        split_rows(12, 4, 4)  # 3 merge groups for 4 ranks
    with pytest.raises(ValueError, match="not whole features"):
        split_rows(10, 4, 2)
    with pytest.raises(ValueError, match="must be >= 1"):
        split_rows(8, 4, 0)


def test_encoders_check_their_share():
    _, image = _encoder("large_image")
    inputs = CASES["large_image"][2]
    with pytest.raises(ValueError, match="multiples of 4"):
        image(**inputs, share=RowShare(2, 8, None))
    with pytest.raises(ValueError, match="within the 140 sequence rows"):
        image(**inputs, share=RowShare(136, 144, None))
    assert image.sequence_rows(inputs) == 140 and image.rows_per_feature == 4
    _, audio = _encoder("long_audio")
    assert audio.sequence_rows(CASES["long_audio"][2]) == 73 and audio.rows_per_feature == 1
    assert is_long_item(image, inputs, 139) and not is_long_item(image, inputs, 140)


def test_check_encoder_sp():
    with torch.device("meta"):
        _, omni = build_model("omni", TINY_OMNI)
        _, both = build_model("omni", {**TINY_OMNI, "encoders": {"image": IMAGE_4_HEADS, "audio": TINY_AUDIO}})
        _, llm = build_model("llm", TINY_OMNI["llm"])
    assert check_encoder_sp(omni, 1, 0) == []
    assert check_encoder_sp(omni, 2, 256) == []
    assert check_encoder_sp(both, 4, 256) == []
    heads = check_encoder_sp(omni, 4, 256)
    assert len(heads) == 1 and "does not divide the 2 attention heads of encoders.image.blocks.0.attn" in heads[0]
    assert "use one of 1, 2" in heads[0]
    low = check_encoder_sp(both, 4, 8)
    assert len(low) == 1 and "encoder_sp_threshold=8 is below" in low[0] and "use at least 16" in low[0]
    assert "runs no media encoders" in check_encoder_sp(llm, 2, 256)[0]
    with pytest.raises(LayoutError, match=r"encoder_sp=4 must divide the 6 ranks"):
        ParallelDims.resolve(ParallelConfig(encoder_sp=4), 6)
    with pytest.raises(LayoutError, match=r"encoder_sp must be >= 1"):
        ParallelDims.resolve(ParallelConfig(encoder_sp=0), 2)
