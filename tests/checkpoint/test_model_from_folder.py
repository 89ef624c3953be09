"""The model section comes from ``checkpoint.init_from_hf`` (``veomni/config/pretrained.py``): a recipe
naming only the folder and its data trains the folder's model, as ``from_pretrained`` would load it
(the parameter count of transformers' / diffusers' own model built from the same config.json), in the
plan and in the real launch alike; the family is the folder's; the folder's tokenizer is
``data.tokenizer`` when none is named; recipe keys override, and the launch check still refuses an
override that changes what the weights compute."""

from __future__ import annotations

import textwrap
from pathlib import Path

import pytest
import torch
import transformers

from tests.config.test_bad_recipes import launch_both_modes
from tests.trainer_utils import TOKENIZER, write_corpus
from veomni.config.load import load_config
from veomni.contract import build_model

QWEN3 = dict(vocab_size=8192, hidden_size=48, intermediate_size=96, num_hidden_layers=3, num_attention_heads=4,
             num_key_value_heads=2, head_dim=16, max_position_embeddings=512, rms_norm_eps=1e-5,
             tie_word_embeddings=False, rope_parameters={"rope_type": "default", "rope_theta": 5e5})
"""Every field unlike our defaults (Qwen3-0.6B's), so a field the fill skips shows."""


def _recipe(folder: Path, body: str) -> Path:
    recipe = folder / "r.yaml"
    recipe.write_text(textwrap.dedent(body))
    return recipe


def _ours(recipe: Path) -> tuple[str, int]:
    """(family, parameter count) of the model a recipe resolves to, built on meta."""
    cfg = load_config(recipe)
    with torch.device("meta"):
        _, model = build_model(cfg.model.arch, cfg.model.options)
    return cfg.model.arch, sum(p.numel() for p in model.parameters())


def _theirs(model_class: type, config) -> int:
    with torch.device("meta"):
        return sum(p.numel() for p in model_class(config).parameters())


@pytest.fixture(scope="module")
def qwen3_folder(tmp_path_factory) -> Path:
    """A Qwen3 folder's config.json and the shipped tokenizer, as save_pretrained writes them."""
    folder = tmp_path_factory.mktemp("qwen3")
    transformers.Qwen3Config(**QWEN3).save_pretrained(folder)
    transformers.AutoTokenizer.from_pretrained(TOKENIZER).save_pretrained(folder)
    return folder


def test_the_recipe_names_only_the_folder(qwen3_folder, tmp_path, monkeypatch, capsys):
    write_corpus(tmp_path / "corpus" / "train", documents=8, seed=0)
    recipe = _recipe(tmp_path, f"""\
        checkpoint: {{init_from_hf: {qwen3_folder}}}
        data: {{train_path: corpus/train, format: jsonl, text_key: text, max_seq_len: 64,
                tokens_per_micro_batch: 128}}
        train: {{output_dir: out, max_steps: 1}}
        """)
    expected = _theirs(transformers.Qwen3ForCausalLM, transformers.Qwen3Config(**QWEN3))
    assert _ours(recipe) == ("llm", expected)
    cfg = load_config(recipe)
    assert cfg.data.tokenizer == str(qwen3_folder)
    assert cfg.model.options["family"] == "qwen3" and cfg.model.options["qk_norm"] is True
    monkeypatch.chdir(tmp_path)
    dry, real = launch_both_modes(recipe, [], capsys)
    assert real[0] == 0 and dry[0] == 0, dry[1] + real[1]
    assert f"parameters    {expected:,}" in dry[1]  # the plan is the folder's model, not the 606M default
    assert "  hidden_size: 48\n" in dry[1] and "  rope_theta: 500000.0\n" in dry[1]
    assert f"model section from {qwen3_folder}/config.json (arch llm); the recipe sets nothing" in dry[1]


def test_recipe_keys_override_and_are_still_compared(qwen3_folder, tmp_path, monkeypatch, capsys):
    write_corpus(tmp_path / "corpus" / "train", documents=8, seed=0)
    recipe = _recipe(tmp_path, f"""\
        model: {{max_position_embeddings: 128}}
        checkpoint: {{init_from_hf: {qwen3_folder}}}
        data: {{train_path: corpus/train, format: jsonl, text_key: text, max_seq_len: 64,
                tokens_per_micro_batch: 128, tokenizer: {TOKENIZER}}}
        train: {{output_dir: out, max_steps: 1}}
        """)
    cfg = load_config(recipe)
    assert cfg.model.options["max_position_embeddings"] == 128  # a free field: the recipe's
    assert cfg.model.options["hidden_size"] == 48 and cfg.data.tokenizer == str(TOKENIZER)
    monkeypatch.chdir(tmp_path)
    for status, output in launch_both_modes(recipe, [], capsys):
        assert status == 0, output
    for status, output in launch_both_modes(recipe, ["--model.rope_theta", "1e6"], capsys):
        assert status == 2 and "rope_theta: recipe 1000000.0, folder 500000.0" in output, output


def test_an_error_in_a_value_from_the_folder_points_at_its_config_json(qwen3_folder, tmp_path, monkeypatch,
                                                                        capsys):
    write_corpus(tmp_path / "corpus" / "train", documents=8, seed=0)
    recipe = _recipe(tmp_path, f"""\
        model: {{num_kv_heads: 3}}
        checkpoint: {{init_from_hf: {qwen3_folder}}}
        data: {{train_path: corpus/train, format: jsonl, text_key: text, max_seq_len: 64,
                tokens_per_micro_batch: 128}}
        """)
    monkeypatch.chdir(tmp_path)
    for status, output in launch_both_modes(recipe, [], capsys):
        assert status == 2, output
        assert f"config error: {qwen3_folder}/config.json, {tmp_path}/r.yaml:1: model.num_heads (4) must be a " \
            "multiple of num_kv_heads (3)" in output, output


def test_a_whole_qwen_vl_folder_gives_arch_and_blocks(tmp_path):
    text = dict(vocab_size=300, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                num_key_value_heads=2, rope_parameters={"rope_type": "default", "rope_theta": 1e4,
                                                        "mrope_section": [2, 3, 3]})
    vision = dict(depth=2, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=64,
                  fullatt_block_indexes=[1], window_size=56)
    config = transformers.Qwen2_5_VLConfig(text_config=text, vision_config=vision, image_token_id=296,
                                           video_token_id=297, vision_start_token_id=298, vision_end_token_id=299)
    config.save_pretrained(tmp_path / "vl")
    recipe = _recipe(tmp_path, f"""\
        model: {{llm: {{max_position_embeddings: 256}}}}
        checkpoint: {{init_from_hf: {tmp_path / 'vl'}}}
        """)
    arch, count = _ours(recipe)
    assert arch == "qwen2_5_vl"
    assert count == _theirs(transformers.Qwen2_5_VLForConditionalGeneration, config)
    options = load_config(recipe).model.options
    assert options["llm"]["max_position_embeddings"] == 256 and options["llm"]["hidden_size"] == 64
    assert options["encoders"]["image"]["window_size"] == 56 and options["image_token_id"] == 296


def test_a_diffusers_wan_folder_gives_the_dit(tmp_path):
    import diffusers

    options = dict(patch_size=(1, 2, 2), num_attention_heads=2, attention_head_dim=8, in_channels=4, out_channels=4,
                   text_dim=16, freq_dim=32, ffn_dim=32, num_layers=2, rope_max_seq_len=64)
    diffusers.WanTransformer3DModel(**options).save_config(tmp_path / "wan")
    recipe = _recipe(tmp_path, f"checkpoint: {{init_from_hf: {tmp_path / 'wan'}}}\n")
    with torch.device("meta"):
        theirs = sum(p.numel() for p in diffusers.WanTransformer3DModel(**options).parameters())
    assert _ours(recipe) == ("dit", theirs)
