"""NativeResolutionViT: packing equals per-image runs, attention stays within an image (frame),
2D RoPE depends only on relative position, gradients, init, FLOPs and config errors (fp32)."""

from __future__ import annotations

import functools
import itertools

import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode

from models.vit import NativeResolutionViT, ViTConfig
from tests.parity_utils import assert_parity
from veomni.contract.plan import match_modules
from veomni.ops.attention import SeqInfo, bidirectional_varlen_attention, sdpa_varlen_attention
from veomni.ops.rope import apply_rope, rope_2d_cos_sin

# (t, gh, gw) in patches: square, wide, tall, a 3-frame video, the smallest image
GRIDS = [(1, 4, 4), (1, 2, 6), (1, 8, 2), (3, 4, 2), (1, 2, 2)]


def tiny_config(**overrides) -> ViTConfig:
    base = dict(
        patch_size=4,
        hidden_size=32,
        num_layers=2,
        num_heads=4,
        intermediate_size=64,
        out_hidden_size=24,
        min_pixels=64,
        max_pixels=64 * 64,
        init_std=0.1,
    )
    return ViTConfig(**{**base, **overrides})


def tiny_model(seed: int = 0, **overrides) -> NativeResolutionViT:
    torch.manual_seed(seed)
    model = NativeResolutionViT(tiny_config(**overrides))
    model.init_weights()
    for block in model.blocks:  # larger norms / biases than the init, so nothing is trivially symmetric
        torch.nn.init.normal_(block.norm1.weight, 1.0, 0.2)
        torch.nn.init.normal_(block.attn.qkv.bias, 0.0, 0.2)
    return model


def inputs(grids, patch_dim: int, seed: int = 1) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randn(t * h * w, patch_dim, generator=gen) for t, h, w in grids]


def _set_attention(model, fn) -> None:
    for _, module in match_modules(model, model.parallel_plan().attention):
        module.attn_fn = fn


ATTENTION_PATHS = {
    "default": None,
    "block-diagonal": functools.partial(sdpa_varlen_attention, block_diagonal=True, causal=False),
    "per-sample": functools.partial(sdpa_varlen_attention, block_diagonal=False, causal=False),
}


@pytest.mark.parametrize("path", ATTENTION_PATHS)
def test_packed_batch_equals_each_image_alone(path) -> None:
    model = tiny_model()
    if ATTENTION_PATHS[path] is not None:
        _set_attention(model, ATTENTION_PATHS[path])
    cfg = model.config
    images = inputs(GRIDS, cfg.patch_dim)
    packed = model(torch.cat(images), torch.tensor(GRIDS))
    alone = [model(x, torch.tensor([grid])) for x, grid in zip(images, GRIDS)]
    counts = model.num_output_tokens(torch.tensor(GRIDS)).tolist()
    assert counts == [t * h * w // 4 for t, h, w in GRIDS]
    assert packed.shape == (sum(counts), cfg.out_hidden_size)
    for got, want in zip(packed.split(counts), alone):
        assert_parity(got, want, "got")


def test_perturbing_one_image_changes_only_its_tokens() -> None:
    model = tiny_model()
    images = inputs(GRIDS, model.config.patch_dim)
    counts = model.num_output_tokens(torch.tensor(GRIDS)).tolist()
    before = model(torch.cat(images), torch.tensor(GRIDS)).split(counts)
    images[1] = images[1] + torch.randn_like(images[1])
    after = model(torch.cat(images), torch.tensor(GRIDS)).split(counts)
    for index, (a, b) in enumerate(zip(before, after)):
        if index == 1:
            assert (a - b).abs().max() > 1e-3
        else:
            assert_parity(a, b, "a")


def test_video_frames_attend_within_their_frame_only() -> None:
    """Frames of one video are separate attention segments: changing frame 2 leaves the merged
    tokens of frames 0 and 1 unchanged."""
    model = tiny_model()
    grid = (3, 4, 2)
    video = inputs([grid], model.config.patch_dim)[0]
    per_frame = 4 * 2
    before = model(video, torch.tensor([grid]))
    changed = video.clone()
    changed[2 * per_frame :] += 1.0
    after = model(changed, torch.tensor([grid]))
    tokens_per_frame = per_frame // 4
    assert_parity(before[: 2 * tokens_per_frame], after[: 2 * tokens_per_frame], "before[:2 * tokens_per_frame]")
    assert (before[2 * tokens_per_frame :] - after[2 * tokens_per_frame :]).abs().max() > 1e-3


def test_2d_rope_scores_depend_only_on_relative_position() -> None:
    head_dim = 16
    gen = torch.Generator().manual_seed(0)
    q, k = torch.randn(1, 1, head_dim, generator=gen), torch.randn(1, 1, head_dim, generator=gen)

    def score(pos_q, pos_k) -> torch.Tensor:
        positions = torch.tensor([pos_q, pos_k])
        cos, sin = rope_2d_cos_sin(positions, head_dim, 100.0, torch.float32)
        rq, _ = apply_rope(q, q, cos[:1], sin[:1])
        rk, _ = apply_rope(k, k, cos[1:], sin[1:])
        return (rq * rk).sum()

    base = score((2, 3), (5, 1))
    for shift in [(1, 0), (0, 7), (4, 4), (-2, 9)]:
        moved = score((2 + shift[0], 3 + shift[1]), (5 + shift[0], 1 + shift[1]))
        assert_parity(moved, base, "moved")
    # rows and columns are different axes: the same offset along each gives different scores
    assert (score((0, 0), (3, 0)) - score((0, 0), (0, 3))).abs() > 1e-3
    with pytest.raises(ValueError, match="divisible by 4"):
        rope_2d_cos_sin(torch.zeros(1, 2), 6, 100.0, torch.float32)


def test_gradients_reach_every_parameter() -> None:
    model = tiny_model()
    images = inputs(GRIDS, model.config.patch_dim)
    patches = torch.cat(images).requires_grad_()
    model(patches, torch.tensor(GRIDS)).square().mean().backward()
    for name, param in model.named_parameters():
        assert param.grad is not None and param.grad.abs().max() > 0, name
    assert patches.grad.abs().max() > 0


@pytest.mark.parametrize("merge_mode", ["avg", "concat"])
def test_merge_adapter_pools_each_group_of_four(merge_mode) -> None:
    """Permuting patches inside one merge group leaves the merged token unchanged only for
    mean pooling; swapping whole groups swaps the tokens in both modes."""
    model = tiny_model(merge_mode=merge_mode)
    x = torch.randn(8, model.config.hidden_size)
    out = model.merger(x)
    within = model.merger(x[[1, 0, 3, 2, 4, 5, 6, 7]])
    swapped = model.merger(x[[4, 5, 6, 7, 0, 1, 2, 3]])
    assert_parity(swapped, out.flip(0), "swapped")
    assert torch.allclose(within, out, atol=1e-6) == (merge_mode == "avg")


def test_init_is_deterministic_and_meta_build_matches() -> None:
    cfg = tiny_config()
    eager = NativeResolutionViT(cfg)
    torch.manual_seed(3)
    eager.init_weights()
    with torch.device("meta"):
        deferred = NativeResolutionViT(cfg)
    deferred.to_empty(device="cpu")
    torch.manual_seed(3)
    deferred.init_weights()
    for (name, a), b in zip(eager.state_dict().items(), deferred.state_dict().values()):
        assert torch.equal(a, b), name


def _naive_attention(q, k, v, seq) -> torch.Tensor:
    """Bidirectional attention per segment as plain batched matmuls (which the counter sees)."""
    out = []
    for a, b in itertools.pairwise(seq.cu_seqlens.tolist()):
        qs, ks, vs = (t[a:b].transpose(0, 1) for t in (q, k, v))  # [H, n, D]
        weights = torch.softmax(qs @ ks.transpose(1, 2) / qs.shape[-1] ** 0.5, dim=-1)
        out.append((weights @ vs).transpose(0, 1))
    return torch.cat(out)


@pytest.mark.parametrize("block_diagonal", [False, True, None])
def test_bidirectional_varlen_attention_matches_dense_reference(block_diagonal) -> None:
    """Per-sample full softmax attention, GQA (4 query heads on 2 K/V heads), zero padding tail."""
    gen = torch.Generator().manual_seed(0)
    lengths, pad = [5, 1, 9, 4], 3
    total = sum(lengths) + pad
    q = torch.randn(total, 4, 8, generator=gen)
    k, v = torch.randn(total, 2, 8, generator=gen), torch.randn(total, 2, 8, generator=gen)
    cu = torch.tensor([0, *itertools.accumulate(lengths)], dtype=torch.int32)
    out = sdpa_varlen_attention(
        q, k, v, SeqInfo(cu, max(lengths)), block_diagonal=block_diagonal, causal=False
    )
    reference = _naive_attention(
        q, k.repeat_interleave(2, dim=1), v.repeat_interleave(2, dim=1), SeqInfo(cu, 9)
    )
    assert_parity(out[: sum(lengths)], reference, "out[:sum(lengths)]")
    assert out[-pad:].abs().max() == 0
    assert_parity(bidirectional_varlen_attention(q, k, v, SeqInfo(cu, 9)), out, "bidirectional varlen attention")


def test_naive_attention_is_the_bidirectional_kernel() -> None:
    model = tiny_model()
    images = torch.cat(inputs(GRIDS, model.config.patch_dim))
    fast = model(images, torch.tensor(GRIDS))
    _set_attention(model, _naive_attention)
    assert_parity(model(images, torch.tensor(GRIDS)), fast, "model(images, torch.tensor(GRIDS))")


def test_training_flops_match_flop_counter() -> None:
    model = tiny_model()
    _set_attention(model, _naive_attention)  # computes exactly the within-frame pairs
    grid = torch.tensor(GRIDS)
    images = torch.cat(inputs(GRIDS, model.config.patch_dim)).requires_grad_()  # count dL/dpatches too
    with FlopCounterMode(display=False) as counter:
        model(images, grid).sum().backward()
    assert counter.get_total_flops() == model.training_flops(grid)


def test_parallel_plan_names_blocks_and_attention() -> None:
    model = tiny_model()
    plan = model.parallel_plan()
    assert [name for name, _ in match_modules(model, plan.blocks)] == ["blocks.0", "blocks.1"]
    assert all(
        hasattr(m, "attn_fn") and m.num_heads == m.num_kv_heads
        for _, m in match_modules(model, plan.attention)
    )


@pytest.mark.parametrize(
    "overrides, message",
    [
        (dict(hidden_size=30, num_heads=4), "divisible by num_heads"),
        (dict(hidden_size=24, num_heads=4), "divisible by 4"),
        (dict(merge_mode="max"), "merge_mode"),
        (dict(hidden_act="relu"), "hidden_act"),
        (dict(min_pixels=10**6, max_pixels=10**5), "min_pixels"),
        (dict(max_pixels=10), "max_pixels"),
        (dict(image_mean=(0.5,)), "one value per channel"),
        (dict(num_layers=0), "num_layers"),
    ],
)
def test_config_errors_name_the_field(overrides, message) -> None:
    with pytest.raises(ValueError, match=message):
        tiny_config(**overrides).validate()


def test_forward_rejects_inconsistent_grid() -> None:
    model = tiny_model()
    with pytest.raises(ValueError, match="divisible by merge_size"):
        model(torch.randn(12, model.config.patch_dim), torch.tensor([[1, 3, 4]]))
    with pytest.raises(ValueError, match=r"patches must be \[16"):
        model(torch.randn(12, model.config.patch_dim), torch.tensor([[1, 4, 4]]))
