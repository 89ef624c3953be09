"""LoRA of the non-LLM families against references we did not write, fp32 within 1e-5: the video
DiT's adapters exported as a PEFT folder load onto diffusers' ``WanTransformer3DModel`` (random
weights from a small config) with our outputs, and a VLM's LLM adapters, exported with the LLM
family's adapter from ``model.llm``, load onto transformers' Qwen3 with the VLM's text outputs.
A DiT weight whose export changes layout (``patch_embedding``, ``proj_out``) is refused by name."""

from __future__ import annotations

import json

import diffusers
import peft
import pytest
import torch
import transformers

from models.dit.config import ARCHITECTURE_FIELDS, DiTConfig
from models.omni.config import OmniConfig
from models.omni.model import OmniModel
from tests.parity_utils import assert_parity
from veomni.adapters.lora import add_lora, init_lora
from veomni.adapters.peft_io import export_peft, load_peft
from veomni.config.schema import LoraConfig
from veomni.contract import get_model_spec, load_plugins

DIT = DiTConfig(patch_size=(1, 2, 2), num_attention_heads=2, attention_head_dim=16, in_channels=3, out_channels=5,
                text_dim=24, freq_dim=32, ffn_dim=64, num_layers=2)
QWEN3 = dict(vocab_size=64, hidden_size=32, intermediate_size=40, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, head_dim=8, tie_word_embeddings=False)
IMAGE = dict(patch_size=14, hidden_size=16, num_layers=1, num_heads=2, intermediate_size=32, out_hidden_size=32)
TOKENS = 12


def _spec(name: str):
    load_plugins(["models"])
    return get_model_spec(name)


def _trained_looking(model: torch.nn.Module) -> None:
    """Random ``lora_B`` (zero at the start, which would hide a wrong mapping)."""
    init_lora(model, torch.Generator().manual_seed(5))
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("lora_B"):
                param.normal_(0.0, 0.2, generator=torch.Generator().manual_seed(len(name)))


def _wan() -> torch.nn.Module:
    torch.manual_seed(0)
    model = diffusers.WanTransformer3DModel(**{key: getattr(DIT, key) for key in ARCHITECTURE_FIELDS}).eval()
    with torch.no_grad():
        for param in model.parameters():
            param.normal_(0.0, 0.1)
    return model


def _dit_from(reference: torch.nn.Module, lora: LoraConfig) -> torch.nn.Module:
    spec = _spec("dit")
    ours = spec.instantiate(DIT)
    ours.load_state_dict(spec.hf_adapter.state_dict_from_hf(reference.state_dict(), DIT))
    return add_lora(ours, lora).eval()


def _video_inputs():
    generator = torch.Generator().manual_seed(1)
    latents = torch.randn(2, DIT.in_channels, 2, 4, 6, generator=generator)
    return latents, torch.tensor([37.0, 912.5]), torch.randn(2, 7, DIT.text_dim, generator=generator)


def test_dit_adapters_load_onto_diffusers_wan_with_our_outputs(tmp_path):
    reference = _wan()
    lora = LoraConfig(rank=4, alpha=8.0)
    ours = _dit_from(reference, lora)
    _trained_looking(ours)
    inputs = _video_inputs()
    with torch.no_grad():
        out, base = ours.forward_video(*inputs), reference(*inputs).sample
    assert (out - base).abs().max() > 1e-3  # the adapters change the outputs

    folder = export_peft(ours, _spec("dit").hf_adapter, DIT, lora, tmp_path / "adapter", task_type=None)
    targets = json.loads((folder / "adapter_config.json").read_text())["target_modules"]
    assert len(targets) == DIT.num_layers * (4 + 4 + 2)  # attn1, attn2 (q, k, v, out), FFN in, out
    assert "blocks.0.attn1.to_out.0" in targets and "blocks.1.ffn.net.2" in targets  # diffusers' names
    theirs = peft.PeftModel.from_pretrained(reference, str(folder)).eval()
    with torch.no_grad():
        assert_parity(theirs(*inputs).sample, out, "peft on diffusers' Wan")

    fresh = _dit_from(_wan(), lora)  # and back: the folder into our model gives the same outputs
    assert load_peft(fresh, folder, _spec("dit").hf_adapter, DIT, lora) == len(targets)
    with torch.no_grad():
        assert_parity(fresh.forward_video(*inputs), out, "the folder back in our DiT")


@pytest.mark.parametrize("target", ["patch_embedding", "proj_out"])
def test_a_dit_weight_whose_export_changes_layout_is_refused_by_name(target, tmp_path):
    lora = LoraConfig(rank=4, alpha=8.0, targets=[target, "to_q"])
    ours = _dit_from(_wan(), lora)
    with pytest.raises(ValueError, match=rf"^{target}\.weight: .*changes this weight's values"):
        export_peft(ours, _spec("dit").hf_adapter, DIT, lora, tmp_path / "adapter", task_type=None)


def _vlm(hf: torch.nn.Module, lora: LoraConfig) -> OmniModel:
    spec = _spec("llm")
    llm_cfg = spec.hf_adapter.config_from_hf(hf.config)
    cfg = OmniConfig(llm={f: getattr(llm_cfg, f) for f in llm_cfg.__dataclass_fields__}, encoders={"image": IMAGE})
    model = OmniModel(cfg)
    model.init_weights()
    model.llm.load_state_dict(spec.hf_adapter.state_dict_from_hf(hf.state_dict(), llm_cfg))
    return add_lora(model, lora).eval()


def _text_logits(model: OmniModel, ids: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():  # no media: the encoders run on their dummy inputs and add exactly zero
        return model(ids, torch.arange(TOKENS), torch.tensor([0, TOKENS], dtype=torch.int32), TOKENS)


def test_vlm_llm_adapters_export_from_model_llm_and_load_onto_transformers(tmp_path):
    torch.manual_seed(0)
    hf = transformers.Qwen3ForCausalLM(transformers.Qwen3Config(**QWEN3)).eval()
    lora = LoraConfig(rank=4, alpha=8.0, train=["encoders.image.merger"],
                      targets=["llm.layers.*.attn.q_proj", "llm.layers.*.attn.v_proj", "down_proj",
                               "encoders.image.blocks.**"])
    ours = _vlm(hf, lora)
    assert any(n.startswith("encoders.image.blocks.") and n.endswith("lora_A") for n, _ in ours.named_parameters())
    _trained_looking(ours)
    ids = torch.randint(0, QWEN3["vocab_size"], (TOKENS,), generator=torch.Generator().manual_seed(1))
    out = _text_logits(ours, ids)
    with torch.no_grad():
        assert (out - hf(ids[None]).logits[0]).abs().max() > 1e-3

    llm = _spec("llm").hf_adapter
    folder = export_peft(ours.llm, llm, ours.config.llm_config, lora, tmp_path / "llm_adapter")
    targets = json.loads((folder / "adapter_config.json").read_text())["target_modules"]
    assert sorted(targets) == sorted(f"model.layers.{i}.{m}" for i in range(2)
                                     for m in ("self_attn.q_proj", "self_attn.v_proj", "mlp.down_proj"))
    theirs = peft.PeftModel.from_pretrained(hf, str(folder)).eval()
    with torch.no_grad():
        assert_parity(theirs(ids[None]).logits[0], out, "peft on transformers' LLM")

    torch.manual_seed(0)
    fresh = _vlm(transformers.Qwen3ForCausalLM(transformers.Qwen3Config(**QWEN3)).eval(), lora)
    assert load_peft(fresh.llm, folder, llm, fresh.config.llm_config, lora) == len(targets)
    for name, param in fresh.llm.named_parameters():
        torch.testing.assert_close(param, ours.llm.get_parameter(name), atol=0, rtol=0, msg=name)
