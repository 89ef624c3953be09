"""Our packed DecoderLM against HF Llama / Qwen2 / Qwen3 built from config with random weights,
both ways: HF weights imported into our model, and our export loaded by AutoModelForCausalLM."""

from __future__ import annotations

import itertools

import pytest
import torch
import transformers
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from models.llm import hf_adapter
from tests.parity_utils import assert_parity
from veomni.checkpoint.hf_io import load_hf_pretrained, save_hf_pretrained
from veomni.contract import build_model
from veomni.data.packing import pack_samples

LENGTHS = (7, 13, 4)
VOCAB = 101

CASES = {
    # tied embeddings + Llama 3 RoPE scaling (positions pass original_max_position_embeddings)
    "llama-tied-rope3": (
        transformers.LlamaConfig,
        {
            "tie_word_embeddings": True,
            "num_key_value_heads": 4,
            "rope_parameters": {
                "rope_type": "llama3",
                "rope_theta": 10000.0,
                "factor": 4.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 8,
            },
        },
    ),
    "qwen2-gqa": (transformers.Qwen2Config, {"num_key_value_heads": 2}),
    "qwen3-gqa": (transformers.Qwen3Config, {"num_key_value_heads": 1}),
}


def _hf_model(name: str) -> transformers.PreTrainedModel:
    config_cls, extra = CASES[name]
    hf_config = config_cls(
        vocab_size=VOCAB,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=4,
        head_dim=16,
        max_position_embeddings=64,
        initializer_range=0.1,
        rms_norm_eps=1e-6,
        **extra,
    )
    torch.manual_seed(0)
    hf = transformers.AutoModelForCausalLM.from_config(hf_config, attn_implementation="eager").eval()
    with torch.no_grad():  # HF inits biases to 0 and norms to 1: perturb them so their mapping is tested
        for param in hf.parameters():
            if param.ndim == 1:
                param.add_(0.1 * torch.randn_like(param))
    return hf


def _packed_batch() -> dict:
    gen = torch.Generator().manual_seed(1)
    return pack_samples([torch.randint(0, VOCAB, (n,), generator=gen).tolist() for n in LENGTHS])


def _hf_logits_per_sample(hf: transformers.PreTrainedModel, batch: dict) -> torch.Tensor:
    bounds = batch["cu_seqlens"].tolist()
    with torch.no_grad():
        return torch.cat([hf(batch["input_ids"][a:b][None]).logits[0] for a, b in itertools.pairwise(bounds)])


def _our_logits(model: torch.nn.Module, batch: dict) -> torch.Tensor:
    with torch.no_grad():
        return model(batch["input_ids"], batch["position_ids"], batch["cu_seqlens"], batch["max_seqlen"])


def _tokenizer_dir(path) -> str:
    """A byte-level BPE like the Llama 3 / Qwen ones (AutoTokenizer may pick the family's class)."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=300, initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(["packed samples never attend across boundaries"] * 4, trainer)
    transformers.PreTrainedTokenizerFast(tokenizer_object=tok).save_pretrained(path)
    return str(path)


@pytest.mark.parametrize("case", sorted(CASES))
def test_import_and_export_match_hf(case: str, tmp_path) -> None:
    hf = _hf_model(case)
    cfg = hf_adapter.config_from_hf(hf.config)
    _, model = build_model("llm", vars(cfg))
    model.load_state_dict(hf_adapter.state_dict_from_hf(hf.state_dict(), cfg), strict=True)
    model.eval()
    batch = _packed_batch()

    ours = _our_logits(model, batch)
    reference = _hf_logits_per_sample(hf, batch)
    assert reference.abs().max() > 1.0, "logits too small for a meaningful tolerance"
    diff = (ours - reference).abs().max().item()
    print(f"{case}: max |logits diff| import {diff:.3g}")
    assert_parity(ours, reference, f"{case}: logits vs transformers")

    out = tmp_path / "export"
    tokenizer_dir = _tokenizer_dir(tmp_path / "tok")
    save_hf_pretrained("llm", cfg, model.state_dict(), out, tokenizer_dir=tokenizer_dir)
    reloaded = transformers.AutoModelForCausalLM.from_pretrained(out).eval()
    assert type(reloaded) is type(hf)
    exported = _hf_logits_per_sample(reloaded, batch)
    print(f"{case}: max |logits diff| export {(ours - exported).abs().max().item():.3g}")
    assert_parity(exported, ours, f"{case}: logits of the exported folder in transformers")
    text = "samples attend across packed boundaries"
    expected = transformers.AutoTokenizer.from_pretrained(tokenizer_dir)(text)["input_ids"]
    assert transformers.AutoTokenizer.from_pretrained(out)(text)["input_ids"] == expected

    arch, cfg_back, sd_back = load_hf_pretrained(out)
    assert (arch, cfg_back) == ("llm", cfg)
    assert all(torch.equal(sd_back[k], v) for k, v in model.state_dict().items())


def test_sharded_export_round_trips(tmp_path) -> None:
    hf = _hf_model("qwen3-gqa")
    cfg = hf_adapter.config_from_hf(hf.config)
    sd = hf_adapter.state_dict_from_hf(hf.state_dict(), cfg)
    save_hf_pretrained("llm", cfg, sd, tmp_path / "out", max_shard_bytes=20_000)
    assert len(list((tmp_path / "out").glob("model-*-of-*.safetensors"))) > 1
    reloaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "out").eval()
    batch = _packed_batch()
    assert_parity(_hf_logits_per_sample(reloaded, batch), _hf_logits_per_sample(hf, batch), "sharded export logits")
    _, _, sd_back = load_hf_pretrained(tmp_path / "out")
    assert sd_back.keys() == sd.keys()


def test_export_replaces_existing_folder_atomically(tmp_path) -> None:
    hf = _hf_model("qwen2-gqa")
    cfg = hf_adapter.config_from_hf(hf.config)
    sd = hf_adapter.state_dict_from_hf(hf.state_dict(), cfg)
    out = tmp_path / "out"
    out.mkdir()
    (out / "stale.txt").write_text("old export")
    save_hf_pretrained("llm", cfg, sd, out)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]
    assert not (out / "stale.txt").exists() and (out / "model.safetensors").is_file()


def test_unsupported_hf_options_are_rejected() -> None:
    with pytest.raises(ValueError, match="o_proj"):
        hf_adapter.config_from_hf(transformers.LlamaConfig(attention_bias=True))
    with pytest.raises(ValueError, match="rope_scaling type 'yarn'"):
        hf_adapter.config_from_hf(
            transformers.Qwen3Config(
                rope_parameters={
                    "rope_type": "yarn",
                    "rope_theta": 1e6,
                    "factor": 8.0,
                    "original_max_position_embeddings": 4096,
                }
            )
        )
