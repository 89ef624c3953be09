"""Multimodal RoPE and the Qwen-VL config's checks: text positions rotate as 1-D RoPE, each axis
alone turns only its section, positions with three distinct axes equal transformers', and each
impossible combination is refused naming its field."""

from __future__ import annotations

import dataclasses

import pytest
import torch
import transformers
from transformers.models.qwen2_5_vl.modeling_qwen2_5_vl import Qwen2_5_VLRotaryEmbedding

from models.llm import DecoderLM, LLMConfig
from models.llm import hf_adapter as llm_adapter
from models.omni import OmniModel, QwenVLConfig
from tests.parity_utils import assert_parity
from veomni.ops.rope import mrope_cos_sin, rope_cos_sin, rope_inv_freq

LLM = dict(vocab_size=64, hidden_size=32, intermediate_size=48, num_layers=1, num_heads=2, num_kv_heads=1,
           head_dim=None, family="qwen2", qkv_bias=True, qk_norm=False, mrope_section=[2, 3, 3])
TOWER = dict(patch_size=2, hidden_size=16, num_layers=2, num_heads=2, intermediate_size=24, hidden_act="silu",
             merge_mode="concat", out_hidden_size=32, temporal_patch_size=2, norm="rmsnorm", mlp="gated",
             window_size=8, full_attention_layers=[1], max_pixels=56 * 56)
IDS = dict(image_token_id=60, video_token_id=61, vision_start_token_id=62, vision_end_token_id=63)


def test_text_positions_rotate_as_1d_rope() -> None:
    inv_freq = rope_inv_freq(16, 10000.0)
    positions = torch.arange(7)
    want = rope_cos_sin(positions, inv_freq, torch.float32)
    got = mrope_cos_sin(positions[:, None].expand(-1, 3), inv_freq, (2, 3, 3), torch.float32)
    assert all(torch.equal(g, w) for g, w in zip(got, want))


@pytest.mark.parametrize("axis, slots", [(0, [0, 1, 8, 9]), (1, [2, 3, 4, 10, 11, 12]),
                                         (2, [5, 6, 7, 13, 14, 15])], ids=["t", "h", "w"])
def test_each_axis_alone_turns_only_its_section(axis, slots) -> None:
    """One axis moved, the others at 0: only that axis's block of slots (and its rotate-half copy)
    turns, by that axis's position; a section reading another axis turns nothing here or turns
    the wrong block (issue 47: moving only h passed a width block that read t)."""
    inv_freq = rope_inv_freq(16, 10000.0)
    moved = torch.zeros(1, 3, dtype=torch.long)
    moved[0, axis] = 5
    cos, sin = mrope_cos_sin(moved, inv_freq, (2, 3, 3), torch.float32)
    assert (cos[0] != 1).nonzero().flatten().tolist() == slots
    angles = 5 * torch.cat((inv_freq, inv_freq))[slots]
    assert_parity(cos[0, slots], angles.cos(), "cos of the moved block")
    assert_parity(sin[0, slots], angles.sin(), "sin of the moved block")


@pytest.mark.parametrize("head_dim, theta, section", [(16, 10.0, [2, 3, 3]), (128, 1e6, [16, 24, 24])],
                         ids=["tiny", "qwen2.5-vl-7b"])
def test_cos_sin_equal_transformers_for_distinct_t_h_w(head_dim, theta, section) -> None:
    """Positions whose three axes all differ (a video's later frames, far into a row) against
    transformers' ``Qwen2_5_VLRotaryEmbedding``, at a tiny and at Qwen2.5-VL-7B's head layout."""
    config = transformers.Qwen2_5_VLTextConfig(
        hidden_size=head_dim * 2, num_attention_heads=2,
        rope_parameters={"rope_type": "default", "rope_theta": theta, "mrope_section": section})
    reference = Qwen2_5_VLRotaryEmbedding(config)
    gen = torch.Generator().manual_seed(0)
    positions = torch.randint(0, 3000, (50, 3), generator=gen)
    want = reference(torch.zeros(1, dtype=torch.float32), positions.T[:, None])
    got = mrope_cos_sin(positions, rope_inv_freq(head_dim, theta), section, torch.float32)
    for ours, theirs, what in zip(got, want, ("cos", "sin")):
        assert_parity(ours, theirs[0], what)


def test_llm_position_shapes() -> None:
    plain = DecoderLM(LLMConfig(**{**LLM, "mrope_section": None}))
    with pytest.raises(ValueError, match="1-D RoPE"):
        plain.rotary(torch.zeros(4, 3, dtype=torch.long), torch.float32)
    mrope = DecoderLM(LLMConfig(**LLM))
    one_d = mrope.rotary(torch.arange(4), torch.float32)
    assert torch.equal(one_d[0], plain.rotary(torch.arange(4), torch.float32)[0])
    with pytest.raises(ValueError, match="mrope_section must be three sizes"):
        LLMConfig(**{**LLM, "mrope_section": [2, 3, 4]}).validate()
    with pytest.raises(ValueError, match="text-only qwen2 model"):
        llm_adapter.config_to_hf(LLMConfig(**LLM))


def _config(**changes) -> QwenVLConfig:
    return QwenVLConfig(**{"llm": dict(LLM), "encoders": {"image": dict(TOWER)}, "tokens_per_second": 2,
                           **IDS, **changes})


def test_qwen_vl_config_refusals() -> None:
    _config().validate()
    cases = {
        "llm.mrope_section is required": dict(llm={**LLM, "mrope_section": None}),
        "model.variant 'qwen2_vl' does not fit": dict(variant="qwen2_vl", tokens_per_second=None),
        "tokens_per_second must be set": dict(tokens_per_second=None),
        "distinct ids below vocab_size": dict(image_token_id=61),
        "one tower for images and videos": dict(encoders={"image": dict(TOWER), "audio": {"out_hidden_size": 32}}),
    }
    for message, changes in cases.items():
        with pytest.raises(ValueError, match=message):
            _config(**changes).validate()


def test_a_row_with_media_needs_3d_positions() -> None:
    cfg = _config()
    model = OmniModel(cfg)
    ids = torch.tensor([1, 62, 60, 63, 2])
    media = {"image": {"inputs": {"patches": torch.zeros(4, cfg.encoder_configs["image"].patch_dim),
                                  "grid_thw": torch.tensor([[1, 2, 2]])}, "positions": torch.tensor([2])}}
    cu_seqlens = torch.tensor([0, 5], dtype=torch.int32)
    with pytest.raises(ValueError, match=r"position_ids \[T, 3\]"):
        model(ids, torch.arange(5), cu_seqlens, 5, media=media)
    positions = cfg.position_ids(ids, cu_seqlens, image_grid_thw=torch.tensor([[1, 2, 2]]))
    assert positions.tolist() == [[0, 0, 0], [1, 1, 1], [2, 2, 2], [3, 3, 3], [4, 4, 4]]
    assert model(ids, positions, cu_seqlens, 5, media=media).shape == (5, 64)
    assert dataclasses.asdict(cfg.llm_config) == cfg.llm  # validate() writes the blocks out in full
