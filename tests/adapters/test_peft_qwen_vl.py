"""LoRA on a whole Qwen2.5-VL against ``peft`` on transformers' ``Qwen2_5_VLForConditionalGeneration``:
adapters on the LLM's attention and MLP and on the vision tower's blocks, exported as one PEFT
folder through the family's own adapter (module names mapped by ``state_dict_to_hf``), loaded by
``peft.PeftModel.from_pretrained`` with our logits on a row of two images and a video (fp32, the parity rule);
and a folder ``peft`` made on the transformers model loads into ours with its logits."""

from __future__ import annotations

import peft
import torch

from tests.models.test_qwen_vl_hf_parity import _assert_same, _hf_logits, _hf_model, _our_logits, _samples
from veomni.adapters.lora import add_lora, init_lora
from veomni.adapters.peft_io import export_peft, load_peft
from veomni.checkpoint.hf_io import load_hf_pretrained
from veomni.config.schema import LoraConfig
from veomni.contract import get_model_spec

TARGETS = ["llm.layers.*.attn.q_proj", "llm.layers.*.attn.v_proj", "llm.layers.*.mlp.down_proj",
           "encoders.image.blocks.*.attn.qkv"]
HF_TARGETS = [r".*language_model\.layers\.\d+\.self_attn\.(q|v)_proj", r".*language_model\.layers\.\d+\.mlp\.down_proj",
              r".*visual\.blocks\.\d+\.attn\.qkv"]


def _ours(folder, lora: LoraConfig):
    arch, cfg, state = load_hf_pretrained(folder)
    model = get_model_spec(arch).instantiate(cfg)
    model.load_state_dict(state)
    add_lora(model, lora)
    init_lora(model)
    return model.eval(), cfg


def test_exported_adapters_load_into_peft_with_our_logits(tmp_path):
    reference = _hf_model("qwen2_5_vl", tied=False)
    reference.save_pretrained(tmp_path / "hf")
    lora = LoraConfig(rank=4, alpha=8.0, targets=TARGETS)
    ours, cfg = _ours(tmp_path / "hf", lora)
    with torch.no_grad():
        for name, param in ours.named_parameters():
            if name.endswith("lora_B"):
                param.normal_(0.0, 0.2, generator=torch.Generator().manual_seed(len(name)))
    samples = _samples(cfg.encoder_configs["image"].patch_dim)
    want = _our_logits(ours, cfg, samples)
    base = _hf_logits(reference, "qwen2_5_vl", samples)
    assert max((a - b).abs().max() for a, b in zip(want, base)) > 1e-3  # the adapters change the logits

    folder = export_peft(ours, get_model_spec("qwen2_5_vl").hf_adapter, cfg, lora, tmp_path / "adapter")
    adapted = peft.PeftModel.from_pretrained(reference, str(folder)).eval()
    _assert_same(_hf_logits(adapted, "qwen2_5_vl", samples), want, "peft on transformers")


def test_a_folder_peft_made_loads_into_ours(tmp_path):
    reference = _hf_model("qwen2_5_vl", tied=False)
    reference.save_pretrained(tmp_path / "hf")
    torch.manual_seed(5)
    made = peft.get_peft_model(reference, peft.LoraConfig(r=4, lora_alpha=8, target_modules="|".join(HF_TARGETS),
                                                          init_lora_weights=False)).eval()
    made.save_pretrained(str(tmp_path / "made"))
    lora = LoraConfig(rank=4, alpha=8.0, targets=TARGETS)
    ours, cfg = _ours(tmp_path / "hf", lora)
    assert load_peft(ours, tmp_path / "made", get_model_spec("qwen2_5_vl").hf_adapter, cfg, lora) == 2 * 3 + 3
    samples = _samples(cfg.encoder_configs["image"].patch_dim)
    _assert_same(_our_logits(ours, cfg, samples), _hf_logits(made, "qwen2_5_vl", samples), "a peft folder in ours")
