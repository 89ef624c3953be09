"""``checkpoint.init_from_hf`` is checked in the launcher, dry run and real run alike: a folder whose
``config.json`` differs from a value the recipe states (the rest is taken from the folder,
``test_model_from_folder.py``) in a field that keeps every weight shape (rope theta, RMSNorm
eps, tied embeddings, rope scaling, MoE top-k normalisation, ...) would load without error and give
other logits, so it is refused naming the field and both values; an option our model does not
compute (a rope type, attention dropout, sliding layers) is refused rather than dropped."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import transformers

from tests.config.test_bad_recipes import BASE, launch_both_modes
from tests.trainer_utils import TOKENIZER, write_corpus

DENSE = dict(vocab_size=8192, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, head_dim=8, max_position_embeddings=256, rms_norm_eps=1e-6,
             tie_word_embeddings=True, rope_parameters={"rope_type": "default", "rope_theta": 1e6})
"""The recipe's model (BASE) as a Hugging Face Qwen3 config."""
MOE_FLAGS = ["--model.num_experts", "4", "--model.num_experts_per_tok", "2", "--model.moe_intermediate_size", "16"]
MOE = dict(DENSE, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16, norm_topk_prob=True)
QWEN2 = {k: v for k, v in DENSE.items() if k != "head_dim"}
"""The recipe's model as a Qwen2 config, which derives head_dim (hidden_size / heads = 8) and states none."""
QWEN2_FLAGS = ["--model.family", "qwen2", "--model.qkv_bias", "true", "--model.qk_norm", "false"]
LLAMA3_ROPE = {"rope_type": "llama3", "rope_theta": 1e6, "factor": 8.0, "low_freq_factor": 1.0,
               "high_freq_factor": 4.0, "original_max_position_embeddings": 64}


@pytest.fixture(scope="module")
def workdir(tmp_path_factory) -> Path:
    folder = tmp_path_factory.mktemp("init_from_hf")
    write_corpus(folder / "corpus" / "train", documents=20, seed=0)
    write_corpus(folder / "corpus" / "eval", documents=4, seed=1)
    (folder / "r.yaml").write_text(BASE.format(tokenizer=TOKENIZER))
    return folder


def _hf_folder(folder: Path, config: transformers.PretrainedConfig) -> Path:
    """A Hugging Face folder as ``save_pretrained`` writes it, random weights, offline."""
    model_class = {"qwen3": transformers.Qwen3ForCausalLM, "qwen3_moe": transformers.Qwen3MoeForCausalLM,
                   "llama": transformers.LlamaForCausalLM, "qwen2": transformers.Qwen2ForCausalLM}[config.model_type]
    model_class(config).save_pretrained(folder)
    return folder


@pytest.mark.parametrize("config_class, kwargs, flags", [
    (transformers.Qwen3Config, DENSE, []),
    (transformers.Qwen3MoeConfig, MOE, MOE_FLAGS),
    (transformers.Qwen2Config, QWEN2, QWEN2_FLAGS),
    (transformers.Qwen2Config, dict(QWEN2, head_dim=8), [*QWEN2_FLAGS, "--model.head_dim", "null"]),
], ids=["qwen3", "qwen3-moe", "qwen2-derived-head-dim", "qwen2-stated-head-dim"])
def test_a_matching_folder_passes(workdir, tmp_path, config_class, kwargs, flags, monkeypatch, capsys):
    monkeypatch.chdir(workdir)
    folder = _hf_folder(tmp_path / "hf", config_class(**kwargs))
    for status, output in launch_both_modes(workdir / "r.yaml", [*flags, "--checkpoint.init_from_hf", str(folder)],
                                            capsys):
        assert status == 0, output


DIFFERENCES = [
    # (id, config class, its kwargs, recipe flags, regex of the refusal)
    ("rope-theta", transformers.Qwen3Config, dict(DENSE, rope_parameters={"rope_type": "default", "rope_theta": 1e4}),
     ["--model.rope_theta", "1e6"], r"rope_theta: recipe 1000000\.0, folder 10000\.0"),
    ("rms-norm-eps", transformers.Qwen3Config, dict(DENSE, rms_norm_eps=1e-5), ["--model.rms_norm_eps", "1e-6"],
     r"rms_norm_eps: recipe 1e-06, folder 1e-05"),
    ("tied-embeddings", transformers.Qwen3Config, dict(DENSE, tie_word_embeddings=False),
     ["--model.tie_embeddings", "true"],
     r"tie_embeddings: recipe True, folder False"),
    ("rope-scaling", transformers.Qwen3Config, dict(DENSE, rope_parameters=LLAMA3_ROPE),
     ["--model.rope_scaling", "null"],
     r"rope_scaling: recipe None, folder \{.*'rope_type': 'llama3'"),
    ("rope-scaling-unsupported", transformers.Qwen3Config,
     dict(DENSE, rope_parameters={"rope_type": "linear", "rope_theta": 1e6, "factor": 2.0}), [],
     r"rope_scaling type 'linear' is not supported"),
    ("partial-rotary", transformers.Qwen3Config,
     dict(DENSE, rope_parameters={"rope_type": "default", "rope_theta": 1e6, "partial_rotary_factor": 0.5}), [],
     r"rope parameters \['partial_rotary_factor'\] of a default rope are not supported"),
    ("attention-dropout", transformers.Qwen3Config, dict(DENSE, attention_dropout=0.1), [],
     r"attention_dropout=0\.1 is not supported"),
    ("sliding-layers", transformers.Qwen3Config,
     dict(DENSE, layer_types=["sliding_attention", "full_attention"], sliding_window=16), [],
     r"layer_types \['sliding_attention'\] are not supported"),
    ("activation", transformers.Qwen3Config, dict(DENSE, hidden_act="gelu"), [], r"hidden_act='gelu'"),
    ("family", transformers.LlamaConfig, {k: v for k, v in DENSE.items()}, ["--model.qk_norm", "true"],
     r"qk_norm: recipe True, folder False; family: recipe 'qwen3', folder 'llama'"),
    ("moe-topk-norm", transformers.Qwen3MoeConfig, dict(MOE, norm_topk_prob=False),
     [*MOE_FLAGS, "--model.norm_topk_prob", "true"],
     r"norm_topk_prob: recipe True, folder False"),
    ("moe-top-k", transformers.Qwen3MoeConfig, dict(MOE, num_experts_per_tok=1), MOE_FLAGS,
     r"num_experts_per_tok: recipe 2, folder 1"),
    ("dense-folder-moe-recipe", transformers.Qwen3Config, DENSE, MOE_FLAGS, r"num_experts: recipe 4, folder 0"),
    ("moe-capacity", transformers.Qwen3MoeConfig, MOE, [*MOE_FLAGS, "--model.capacity_factor", "1.0"],
     r"capacity_factor: recipe 1\.0, folder 0\.0"),
    ("qwen2-moe-no-qkv-bias", transformers.Qwen2MoeConfig, dict(MOE, qkv_bias=False, shared_expert_intermediate_size=0),
     [*MOE_FLAGS, *QWEN2_FLAGS], r"qkv_bias=false"),
]


@pytest.mark.parametrize("case_id, config_class, kwargs, flags, needle", DIFFERENCES,
                         ids=[case[0] for case in DIFFERENCES])
def test_a_differing_folder_is_refused(workdir, tmp_path, case_id, config_class, kwargs, flags, needle,
                                       monkeypatch, capsys):
    monkeypatch.chdir(workdir)
    folder = tmp_path / "hf"
    config_class(**kwargs).save_pretrained(folder)  # the launcher reads config.json alone
    results = launch_both_modes(workdir / "r.yaml", [*flags, "--checkpoint.init_from_hf", str(folder)], capsys)
    for status, output in results:
        assert status == 2, output
        assert re.search(rf"config error: checkpoint\.init_from_hf: .*{needle}", output), output
        assert "Traceback" not in output
    assert results[0][1] == results[1][1], "a dry run must fail with the real run's message"


FINE_TUNING = {"lora": ["--lora.rank", "4"], "chat-lora": ["--data.kind", "chat_text", "--lora.rank", "4"],
               "chat-lora-targets": ["--data.kind", "chat_text", "--lora.rank", "4", "--lora.targets", "[q_proj]"]}
"""The fine-tuning recipes a user walks: the same folder checks must hold for each (a LoRA / chat
plan once showed a default model while the launch refused the folder)."""


@pytest.mark.parametrize("variant", sorted(FINE_TUNING))
@pytest.mark.parametrize("case_id", ["rope-theta", "family", "dense-folder-moe-recipe"])
def test_a_differing_folder_is_refused_for_lora_and_chat_alike(workdir, tmp_path, case_id, variant, monkeypatch,
                                                               capsys):
    _, config_class, kwargs, flags, needle = next(case for case in DIFFERENCES if case[0] == case_id)
    monkeypatch.chdir(workdir)
    folder = tmp_path / "hf"
    config_class(**kwargs).save_pretrained(folder)
    results = launch_both_modes(workdir / "r.yaml", [*flags, *FINE_TUNING[variant], "--checkpoint.init_from_hf",
                                                     str(folder)], capsys)
    for status, output in results:
        assert status == 2 and "Traceback" not in output, output
        assert re.search(rf"config error: checkpoint\.init_from_hf: .*{needle}", output), output
    assert results[0][1] == results[1][1], "a dry run must fail with the real run's message"
