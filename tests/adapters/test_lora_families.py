"""LoRA on the VLM, the audio model and the video DiT, on meta models of their tiny recipes: what the
default targets adapt (an omni model's LLM blocks, not its encoders; the DiT's blocks, not its
embeddings or head), that patterns reach each part, and the launcher's ``lora`` pre-flight:
patterns matching nothing and contradictions with ``model.freeze`` refused naming the key before
any worker starts, a frozen base nothing loads warned about, not refused."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch

from veomni import launch
from veomni.adapters.lora import add_lora, lora_targets
from veomni.checkpoint.lora_checks import check_lora
from veomni.config.load import load_config
from veomni.config.schema import LoraConfig
from veomni.contract import build_model, load_plugins

RECIPES = Path(__file__).resolve().parents[2] / "recipes"
VLM, AUDIO, DIT = "seed1.5-vl/tiny.yaml", "audio/tiny_audio_caption.yaml", "goku/tiny_t2v.yaml"


def _meta(recipe: str, *overrides: str):
    cfg = load_config(RECIPES / recipe, list(overrides))
    load_plugins(cfg.model.plugins)
    with torch.device("meta"):
        return cfg, build_model(cfg.model.arch, cfg.model.options)[1]


def _adapted(recipe: str, **lora) -> list[str]:
    _, model = _meta(recipe)
    linears, experts = lora_targets(model, LoraConfig(rank=4, **lora))
    return [path for path, _ in linears + experts]


@pytest.mark.parametrize("recipe", [VLM, AUDIO])
def test_an_omni_model_adapts_its_llm_by_default_and_its_encoders_when_named(recipe):
    default = _adapted(recipe)
    assert len(default) == 4 * 7 and all(p.startswith("llm.layers.") for p in default)
    name = "image" if recipe == VLM else "audio"
    encoder = _adapted(recipe, targets=[f"encoders.{name}.blocks.*.attn.qkv"])
    assert encoder == [f"encoders.{name}.blocks.{i}.attn.qkv" for i in range(4)]
    assert set(_adapted(recipe, targets=["llm.layers.*.attn.q_proj"])) == {f"llm.layers.{i}.attn.q_proj"
                                                                          for i in range(4)}
    everything = _adapted(recipe, targets=[f"encoders.{name}.**"])
    adapter = "merger.fc1" if recipe == VLM else "proj"
    assert f"encoders.{name}.{adapter}" in everything and len(everything) > 4 * 4


@pytest.mark.parametrize("recipe, projector", [(VLM, "encoders.image.merger"), (AUDIO, "encoders.audio.proj")])
def test_lora_train_names_the_projector_trained_whole(recipe, projector):
    _, model = _meta(recipe)
    add_lora(model, LoraConfig(rank=4, train=[projector]))
    trained = {n for n, p in model.named_parameters() if p.requires_grad and "lora_" not in n}
    assert trained and all(n.startswith(projector + ".") for n in trained)
    assert not any(p.requires_grad for n, p in model.named_parameters() if n.startswith("encoders.") and
                   not n.startswith(projector + "."))


def test_the_dit_adapts_the_linear_layers_of_its_blocks_by_default():
    default = _adapted(DIT)
    assert len(default) == 4 * 10 and all(p.startswith("blocks.") for p in default)
    assert _adapted(DIT, targets=["blocks.*.attn1.to_q", "proj_out"])[-1] == "proj_out"


def _launch(recipe: str, *overrides: str, capsys) -> tuple[int, str]:
    status = launch.main([str(RECIPES / recipe), "--dry-run", "--world-size", "2", *overrides])
    captured = capsys.readouterr()
    return status, captured.out + captured.err


@pytest.mark.parametrize("recipe, overrides, needle", [
    (VLM, ["--lora.targets", "[llm.layers.*.attn.qq_proj]"], r"lora\.targets entry 'llm\.layers\.\*\.attn\.qq_proj' "
                                                             r"matches no linear layer"),
    (AUDIO, ["--lora.train", "[projector]"], r"lora\.train entries \['projector'\] match no module"),
    (DIT, ["--lora.targets", "[to_q, blocks.*.ffn.fc_mid]"], r"lora\.targets entry 'blocks\.\*\.ffn\.fc_mid'"),
    (VLM, ["--model.freeze", "[encoders.image]", "--lora.targets", "[encoders.image.blocks.**]"],
     r"lora\.targets adapts encoders\.image\.blocks\.0\..*which the model config freezes \(model\.freeze\)"),
    (VLM, ["--model.freeze", "[adapters.image]", "--lora.train", "[merger]"],
     r"lora\.train trains encoders\.image\.merger\..*which the model config freezes"),
])
def test_the_launcher_refuses_lora_patterns_before_any_worker(recipe, overrides, needle, capsys, tmp_path):
    status, output = _launch(recipe, "--lora.rank", "4", "--train.output_dir", str(tmp_path), *overrides,
                             capsys=capsys)
    assert status == 2 and "Traceback" not in output, output
    assert re.search(needle, output), output


def test_the_launcher_refuses_a_peft_folder_that_cannot_start_the_adapters(capsys, tmp_path):
    status, output = _launch(VLM, "--lora.rank", "4", "--lora.init_from_peft", str(tmp_path / "none"),
                             "--train.output_dir", str(tmp_path), capsys=capsys)
    assert status == 2 and "has no Hugging Face adapter to map a PEFT folder" in output, output
    folder = tmp_path / "adapter"
    folder.mkdir()
    (folder / "adapter_config.json").write_text('{"peft_type": "LORA", "r": 8, "lora_alpha": 16}')
    (folder / "adapter_model.safetensors").write_bytes(b"")
    status, output = _launch("quickstart/tiny_llm.yaml", "--lora.rank", "4", "--lora.init_from_peft", str(folder),
                             "--train.output_dir", str(tmp_path), capsys=capsys)
    assert status == 2 and "has r=8, lora_alpha=16, use_rslora=False; the recipe has lora.rank=4" in output, output
    status, output = _launch("quickstart/tiny_llm.yaml", "--lora.rank", "4", "--lora.init_from_peft",
                             str(tmp_path / "missing"), "--train.output_dir", str(tmp_path), capsys=capsys)
    assert status == 2 and "adapter_config.json is missing" in output, output


def test_a_lora_run_on_the_seeded_init_is_warned_not_refused(capsys, tmp_path):
    status, output = _launch(DIT, "--lora.rank", "4", "--train.output_dir", str(tmp_path), capsys=capsys)
    assert status == 0, output
    assert "warning: lora: the frozen base of patch_embedding, condition_embedder, blocks, proj_out" in output
    assert "seeded random init (train.seed=42)" in output


def test_no_warning_where_the_pretrained_entries_load_the_whole_base(tmp_path):
    cfg, model = _meta(VLM, "--lora.rank", "4", "--lora.train", "[encoders.image.merger]")
    cfg.checkpoint.init = {"llm": str(tmp_path / "llm")}  # the folders' contents are the launcher's check_init
    problems, warnings = check_lora(model, cfg)
    assert not problems and len(warnings) == 1 and "frozen base of encoders.image is" in warnings[0]
    cfg, model = _meta(VLM, "--lora.rank", "4")
    cfg.checkpoint.init = {"llm": str(tmp_path / "llm"), "encoders.image": str(tmp_path / "vision")}
    assert check_lora(model, cfg) == ([], [])
    cfg, model = _meta(DIT, "--lora.rank", "4")
    cfg.checkpoint.init_from_hf = str(tmp_path / "wan")
    assert check_lora(model, cfg) == ([], [])
