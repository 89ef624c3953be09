"""LoRA against PEFT, a reference we did not write: our adapters exported as a PEFT folder and
loaded by ``peft.PeftModel.from_pretrained`` onto the transformers model give our outputs, and a
folder ``peft`` made itself (``get_peft_model`` on a random transformers model) loads into ours
with the same outputs; merged weights equal the adapted model. Dense and MoE (one adapter per
expert, PEFT's ``target_parameters``), fp32."""

from __future__ import annotations

import peft
import pytest
import torch
import transformers

from tests.parity_utils import assert_parity
from veomni.adapters.lora import add_lora, init_lora, merge_lora
from veomni.adapters.peft_io import export_peft, load_peft
from veomni.config.schema import LoraConfig
from veomni.contract import get_model_spec, load_plugins

TOKENS = 12
COMMON = dict(vocab_size=64, hidden_size=32, intermediate_size=40, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, head_dim=8, tie_word_embeddings=False)
EXPERT_WEIGHTS = ["mlp.experts.gate_up_proj", "mlp.experts.down_proj"]


def _hf_model(moe: bool) -> torch.nn.Module:
    torch.manual_seed(0)
    if moe:
        config = transformers.Qwen3MoeConfig(moe_intermediate_size=24, num_experts=4, num_experts_per_tok=2,
                                             decoder_sparse_step=1, mlp_only_layers=[], **COMMON)
        return transformers.Qwen3MoeForCausalLM(config).eval()
    return transformers.Qwen3ForCausalLM(transformers.Qwen3Config(**COMMON)).eval()


def _ours(hf: torch.nn.Module, lora: LoraConfig):
    load_plugins(["models"])
    spec = get_model_spec("llm")
    cfg = spec.hf_adapter.config_from_hf(hf.config)
    model = spec.instantiate(cfg)
    model.load_state_dict(spec.hf_adapter.state_dict_from_hf(hf.state_dict(), cfg))
    add_lora(model, lora)
    init_lora(model)
    return model.eval(), spec.hf_adapter, cfg


def _logits(model: torch.nn.Module, ids: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return model(ids, torch.arange(TOKENS), torch.tensor([0, TOKENS], dtype=torch.int32), TOKENS)


@pytest.mark.parametrize("moe", [False, True], ids=["dense", "moe"])
def test_exported_adapters_load_into_peft_with_our_outputs(moe, tmp_path):
    hf = _hf_model(moe)
    lora = LoraConfig(rank=4, alpha=8.0)
    ours, adapter, cfg = _ours(hf, lora)
    with torch.no_grad():  # trained-looking adapters: B is zero at the start
        for name, param in ours.named_parameters():
            if name.endswith("lora_B"):
                param.normal_(0.0, 0.2, generator=torch.Generator().manual_seed(len(name)))
    ids = torch.randint(0, 64, (TOKENS,), generator=torch.Generator().manual_seed(1))
    ours_out = _logits(ours, ids)
    with torch.no_grad():
        base_out = hf(ids[None]).logits[0]
    assert (ours_out - base_out).abs().max() > 1e-3  # the adapters change the outputs

    folder = export_peft(ours, adapter, cfg, lora, tmp_path / "adapter")
    if moe:
        config = __import__("json").loads((folder / "adapter_config.json").read_text())
        assert len(config["target_parameters"]) == 2 * 2  # two grouped weights in each of two layers
    reference = peft.PeftModel.from_pretrained(hf, str(folder)).eval()
    with torch.no_grad():
        theirs = reference(ids[None]).logits[0]
    assert_parity(ours_out, theirs, "our adapted logits vs peft's")

    load_plugins(["models"])
    plain = get_model_spec("llm").instantiate(cfg).eval()
    plain.load_state_dict(merge_lora(ours.state_dict(), ours))
    assert_parity(_logits(plain, ids), ours_out, "merged vs adapted logits")


@pytest.mark.parametrize("moe", [False, True], ids=["dense", "moe"])
def test_a_folder_peft_made_loads_into_ours_with_its_outputs(moe, tmp_path):
    hf = _hf_model(moe)
    targets = ["q_proj", "k_proj", "v_proj", "o_proj"] + ([] if moe else ["gate_proj", "up_proj", "down_proj"])
    config = peft.LoraConfig(r=4, lora_alpha=8, target_modules=targets, init_lora_weights=False,
                             target_parameters=EXPERT_WEIGHTS if moe else None)
    torch.manual_seed(3)
    made = peft.get_peft_model(hf, config).eval()
    made.save_pretrained(str(tmp_path / "made"))
    ids = torch.randint(0, 64, (TOKENS,), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        theirs = made(ids[None]).logits[0]

    lora = LoraConfig(rank=4, alpha=8.0, targets=targets + (["experts"] if moe else []))
    ours, adapter, cfg = _ours(_hf_model(moe), lora)  # the same random base (seeded), a fresh copy
    assert load_peft(ours, tmp_path / "made", adapter, cfg, lora) == len(targets) * 2 + (4 if moe else 0)
    assert_parity(_logits(ours, ids), theirs, "peft's folder in our model")


def test_a_folder_of_another_rank_is_refused_by_name(tmp_path):
    hf = _hf_model(False)
    ours, adapter, cfg = _ours(hf, LoraConfig(rank=4, alpha=8.0))
    export_peft(ours, adapter, cfg, LoraConfig(rank=4, alpha=8.0), tmp_path / "a")
    other, _, _ = _ours(hf, LoraConfig(rank=2, alpha=8.0))
    with pytest.raises(ValueError, match="lora.rank=2"):
        load_peft(other, tmp_path / "a", adapter, cfg, LoraConfig(rank=2, alpha=8.0))


def test_a_corrupt_adapter_file_is_refused_by_name(tmp_path):
    hf = _hf_model(False)
    lora = LoraConfig(rank=4, alpha=8.0)
    ours, adapter, cfg = _ours(hf, lora)
    folder = export_peft(ours, adapter, cfg, lora, tmp_path / "a")
    (folder / "adapter_model.safetensors").write_bytes(b"\x00" * 7)
    with pytest.raises(ValueError, match="adapter_model.safetensors is not a readable safetensors file"):
        load_peft(ours, folder, adapter, cfg, lora)
