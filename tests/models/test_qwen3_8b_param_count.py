"""Our Qwen3-8B config has exactly HF Qwen3ForCausalLM's parameters (built on meta, no memory)."""

from __future__ import annotations

import torch
import transformers

from models.llm import hf_adapter
from veomni.contract import build_model

QWEN3_8B = {
    "vocab_size": 151936,
    "hidden_size": 4096,
    "intermediate_size": 12288,
    "num_layers": 36,
    "num_heads": 32,
    "num_kv_heads": 8,
    "head_dim": 128,
    "rope_theta": 1_000_000.0,
    "rms_norm_eps": 1e-6,
    "tie_embeddings": False,
    "qk_norm": True,
    "qkv_bias": False,
    "max_position_embeddings": 40960,
    "family": "qwen3",
}


def test_qwen3_8b_param_count_matches_transformers() -> None:
    with torch.device("meta"):
        cfg, model = build_model("llm", QWEN3_8B)
        hf = transformers.Qwen3ForCausalLM(hf_adapter.config_to_hf(cfg))
    ours = model.num_params()
    assert ours == sum(p.numel() for p in hf.parameters())
    assert abs(ours - 8.19e9) / 8.19e9 < 0.01
    assert hf_adapter.state_dict_to_hf(model.state_dict(), cfg).keys() == hf.state_dict().keys()
