"""Multimodal RoPE and the Qwen-VL config's checks: text positions rotate as 1-D RoPE, the block
split follows ``mrope_section``, and each impossible combination is refused naming its field."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from models.llm import DecoderLM, LLMConfig
from models.llm import hf_adapter as llm_adapter
from models.omni import OmniModel, QwenVLConfig
from veomni.ops.rope import mrope_cos_sin, rope_cos_sin, rope_inv_freq

LLM = dict(vocab_size=64, hidden_size=32, intermediate_size=48, num_layers=1, num_heads=2, num_kv_heads=1,
           head_dim=None, family="qwen2", qkv_bias=True, qk_norm=False, mrope_section=[2, 3, 3])
TOWER = dict(patch_size=2, hidden_size=16, num_layers=2, num_heads=2, intermediate_size=24, hidden_act="silu",
             merge_mode="concat", out_hidden_size=32, temporal_patch_size=2, norm="rmsnorm", mlp="gated",
             window_size=8, full_attention_layers=[1], max_pixels=56 * 56)
IDS = dict(image_token_id=60, video_token_id=61, vision_start_token_id=62, vision_end_token_id=63)


def test_text_positions_rotate_as_1d_rope_and_sections_pick_axes() -> None:
    inv_freq = rope_inv_freq(16, 10000.0)
    positions = torch.arange(7)
    want = rope_cos_sin(positions, inv_freq, torch.float32)
    got = mrope_cos_sin(positions[:, None].expand(-1, 3), inv_freq, (2, 3, 3), torch.float32)
    assert all(torch.equal(g, w) for g, w in zip(got, want))
    # only the h axis moves: only the h block of slots (2..4, and its rotate-half copy) changes
    moved = torch.tensor([[0, 5, 0]])
    cos, _ = mrope_cos_sin(moved, inv_freq, (2, 3, 3), torch.float32)
    changed = (cos[0] != 1).nonzero().flatten().tolist()
    assert changed == [2, 3, 4, 10, 11, 12]


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
