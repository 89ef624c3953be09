"""Our MoE DecoderLM against HF Qwen3-MoE / Qwen2-MoE built from config with random weights:
same logits (fp32, by the parity rule of tests/parity_utils.py) and the same experts chosen for
every token, both on import and after our export is loaded back by ``AutoModelForCausalLM``."""

from __future__ import annotations

import itertools

import pytest
import torch
import transformers

from models.llm import hf_adapter
from tests.parity_utils import assert_parity
from veomni.checkpoint.hf_io import load_hf_pretrained, save_hf_pretrained
from veomni.contract import build_model
from veomni.data.packing import pack_samples

VOCAB = 101
LENGTHS = (17, 23, 11)
COMMON = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, moe_intermediate_size=32, num_hidden_layers=2,
              num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=64,
              initializer_range=0.1, num_experts=8, num_experts_per_tok=2)
CASES = {
    "qwen3_moe-norm-topk": (transformers.Qwen3MoeConfig, {"norm_topk_prob": True}),
    "qwen3_moe-raw-topk": (transformers.Qwen3MoeConfig, {"norm_topk_prob": False, "tie_word_embeddings": True}),
    "qwen2_moe-shared": (transformers.Qwen2MoeConfig, {"shared_expert_intermediate_size": 48}),
}


def _hf_model(case: str) -> transformers.PreTrainedModel:
    config_cls, extra = CASES[case]
    torch.manual_seed(0)
    hf = transformers.AutoModelForCausalLM.from_config(config_cls(**COMMON, **extra), attn_implementation="eager")
    with torch.no_grad():  # HF starts routers at zero and norms at one: randomise both
        for name, param in hf.named_parameters():
            if param.ndim == 1 or name.endswith("mlp.gate.weight"):
                param.copy_(torch.randn_like(param) * 0.1 + (param.ndim == 1))
    return hf.eval()


def _batch() -> dict:
    gen = torch.Generator().manual_seed(1)
    return pack_samples([torch.randint(0, VOCAB, (n,), generator=gen).tolist() for n in LENGTHS])


def _hf_run(hf, batch) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """Logits [T, V] and, per layer, the chosen experts [T, k] (sorted), sample by sample."""
    logits, choices = [], []
    k = hf.config.num_experts_per_tok
    with torch.no_grad():
        for a, b in itertools.pairwise(batch["cu_seqlens"].tolist()):
            out = hf(batch["input_ids"][a:b][None], output_router_logits=True)
            logits.append(out.logits[0])
            choices.append([torch.topk(torch.softmax(r.float(), -1), k, -1).indices for r in out.router_logits])
    per_layer = [torch.cat(layer).sort(-1).values for layer in zip(*choices)]
    return torch.cat(logits), per_layer


def _our_run(model, batch) -> tuple[torch.Tensor, list[torch.Tensor]]:
    choices = []
    hooks = [m.router.register_forward_hook(lambda _m, _i, out: choices.append(out[2].sort(-1).values))
             for m in model.moe_layers()]
    with torch.no_grad():
        logits = model(batch["input_ids"], batch["position_ids"], batch["cu_seqlens"], batch["max_seqlen"])
    for hook in hooks:
        hook.remove()
    return logits, choices


@pytest.mark.parametrize("case", sorted(CASES))
def test_moe_import_and_export_match_hf(case, tmp_path):
    hf = _hf_model(case)
    cfg = hf_adapter.config_from_hf(hf.config)
    assert cfg.is_moe and cfg.num_experts == 8
    _, model = build_model("llm", vars(cfg))
    model.load_state_dict(hf_adapter.state_dict_from_hf(hf.state_dict(), cfg), strict=True)
    model.eval()
    batch = _batch()
    ours, our_choice = _our_run(model, batch)
    reference, hf_choice = _hf_run(hf, batch)
    assert reference.abs().max() > 1.0
    diff = (ours - reference).abs().max().item()
    print(f"{case}: max |logits diff| import {diff:.3g}")
    assert_parity(ours, reference, f"{case}: logits vs transformers")
    for layer, (a, b) in enumerate(zip(our_choice, hf_choice, strict=True)):
        assert torch.equal(a, b), f"layer {layer}: router choices differ"
    if case.startswith("qwen3"):  # every expert is used, so a mis-mapped one would show in the logits
        assert all(layer.unique().numel() == cfg.num_experts for layer in our_choice)

    out = tmp_path / "export"
    save_hf_pretrained("llm", cfg, model.state_dict(), out)
    reloaded = transformers.AutoModelForCausalLM.from_pretrained(out).eval()
    assert type(reloaded) is type(hf)
    export_logits, export_choice = _hf_run(reloaded, batch)
    print(f"{case}: max |logits diff| export {(ours - export_logits).abs().max().item():.3g}")
    assert_parity(export_logits, ours, f"{case}: logits of the exported folder in transformers")
    assert all(torch.equal(a, b) for a, b in zip(our_choice, export_choice, strict=True))
    arch, cfg_back, sd_back = load_hf_pretrained(out)
    assert (arch, cfg_back) == ("llm", cfg)
    assert all(torch.equal(sd_back[k], v) for k, v in model.state_dict().items())


def test_moe_options_hf_cannot_express_are_rejected_on_export():
    cfg = hf_adapter.config_from_hf(transformers.Qwen3MoeConfig(**COMMON))
    for field, value in (("router_scoring", "sigmoid"), ("router_bias_update_rate", 1e-3)):
        bad = type(cfg)(**{**vars(cfg), field: value})
        with pytest.raises(ValueError, match=field):
            hf_adapter.config_to_hf(bad)


def test_incomplete_per_expert_weights_are_rejected():
    hf = _hf_model("qwen3_moe-norm-topk")
    cfg = hf_adapter.config_from_hf(hf.config)
    per_expert = hf_adapter.state_dict_to_hf(hf_adapter.state_dict_from_hf(hf.state_dict(), cfg), cfg)
    del per_expert["model.layers.1.mlp.experts.3.up_proj.weight"]
    with pytest.raises(KeyError, match="incomplete"):
        hf_adapter.state_dict_from_hf(per_expert, cfg)
