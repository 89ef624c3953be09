"""``checkpoint.init``: a VLM starts from an LLM saved as a Hugging Face folder and a Qwen2-VL
vision-tower folder (2 FSDP ranks, LLM frozen); a folder that does not fit, an unknown sub-module
and a frozen part nothing loads are refused before any worker starts; the stage-1 recipes refuse
to plan or launch without their folders."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
import transformers
from safetensors.torch import load_file, save_file
from torch import nn
from transformers.models.qwen2_vl.configuration_qwen2_vl import Qwen2VLVisionConfig
from transformers.models.qwen2_vl.modeling_qwen2_vl import Qwen2VisionTransformerPretrainedModel

from harness.gloo_ranks import run_distributed
from harness.media_bytes import png_bytes
from models.llm import hf_adapter as llm_adapter
from models.llm.config import LLMConfig
from models.vit import hf_adapter as vit_adapter
from tests.omni_utils import TINY_OMNI, TOKENIZER, chat_record, write_shard
from tests.parity_utils import assert_parity, full_params
from veomni.checkpoint.component_init import load_components
from veomni.config.load import load_config
from veomni.config.schema import (
    CheckpointConfig,
    DataConfig,
    LogConfig,
    ModelConfig,
    ParallelConfig,
    RunConfig,
    TrainConfig,
)
from veomni.contract import register_hf_adapter
from veomni.train.trainer import Trainer

REPO = Path(__file__).resolve().parents[2]
TINY_VLM = REPO / "recipes" / "seed1.5-vl" / "tiny.yaml"
# The tiny VLM with a Qwen2-VL-style image encoder (concatenating 2x2 merge), its LLM frozen.
VLM_OPTIONS = {**TINY_OMNI, "encoders": {"image": {**TINY_OMNI["encoders"]["image"], "merge_mode": "concat"}},
               "freeze": ["llm"]}
TEXT = [5, 812, 97, 3001, 44, 8191, 0, 17, 256, 1024, 7]


def _qwen3_config(**dims) -> transformers.Qwen3Config:
    """A Qwen3 config with the tiny omni LLM's dimensions (tests/omni_utils.py), changed by ``dims``."""
    return transformers.Qwen3Config(**{
        "vocab_size": 8200, "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2,
        "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 8, "max_position_embeddings": 256,
        "tie_word_embeddings": True, "rms_norm_eps": 1e-6,
        "rope_parameters": {"rope_type": "default", "rope_theta": 1e6}, **dims})


def _randomised(model: nn.Module, seed: int) -> nn.Module:
    """HF leaves norms at 1 and biases at 0: perturb every parameter so that each mapping counts."""
    torch.manual_seed(seed)
    with torch.no_grad():
        for param in model.parameters():
            param.add_(torch.randn_like(param) * 0.1)
    return model.eval()


def _pretrained_folders(tmp: Path) -> tuple[Path, Path, nn.Module, nn.Module]:
    llm = _randomised(transformers.Qwen3ForCausalLM(_qwen3_config()), seed=11)
    vision_config = Qwen2VLVisionConfig(depth=2, embed_dim=32, hidden_size=32, num_heads=2, mlp_ratio=2,
                                        hidden_act="gelu", patch_size=14, spatial_merge_size=2)
    vision = _randomised(Qwen2VisionTransformerPretrainedModel(vision_config), seed=12)
    llm.save_pretrained(tmp / "qwen3-llm")
    vision.save_pretrained(tmp / "qwen2vl-vision")
    return tmp / "qwen3-llm", tmp / "qwen2vl-vision", llm, vision


def _vqa_shard(folder: Path) -> Path:
    records = [chat_record(f"s{i}", "What color is it?", ["red", "blue"][i % 2], png_bytes(i))
               for i in range(24)]
    write_shard(folder / "shard-000000.tar", records)
    return folder


def _run_config(tmp: Path, init: dict[str, str]) -> RunConfig:
    return RunConfig(
        model=ModelConfig(arch="omni", options=VLM_OPTIONS),
        data=DataConfig(train_path=str(tmp / "vqa"), tokenizer=str(TOKENIZER), text_key="json",
                        max_seq_len=128, tokens_per_micro_batch=256),
        parallel=ParallelConfig(),
        train=TrainConfig(output_dir=str(tmp / "out"), max_steps=3, seed=5, lr=1e-2, warmup_steps=0,
                          device="cpu"),
        checkpoint=CheckpointConfig(resume="none", save_final=False, init=init),
        log=LogConfig(progress_bar=False),
    )


def _text_logits(model: nn.Module) -> torch.Tensor:
    """Logits of one text-only sample (every rank runs it: FSDP's all-gathers need them all)."""
    ids = torch.tensor(TEXT)
    with torch.no_grad():
        return model(ids, torch.arange(len(TEXT)), torch.tensor([0, len(TEXT)], dtype=torch.int32), len(TEXT))


def _train(rank: int, world: int, tmp: str, init: dict[str, str]) -> dict:
    trainer = Trainer(_run_config(Path(tmp), init))
    before, logits = full_params(trainer.model), _text_logits(trainer.model)
    history = trainer.train()
    return {"before": before, "logits": logits, "after": full_params(trainer.model),
            "losses": [m["loss"] for m in history]}


def test_vlm_starts_from_a_pretrained_llm_and_vision_tower(tmp_path):
    llm_dir, vision_dir, llm, vision = _pretrained_folders(tmp_path)
    _vqa_shard(tmp_path / "vqa")
    init = {"llm": str(llm_dir), "encoders.image": str(vision_dir)}
    result = run_distributed(_train, 2, str(tmp_path), init)[0]
    assert len(result["losses"]) == 3 and all(torch.isfinite(torch.tensor(result["losses"])))

    def part(params: dict, prefix: str) -> dict[str, torch.Tensor]:
        return {name.removeprefix(prefix): value for name, value in params.items() if name.startswith(prefix)}

    # The frozen LLM, after training, is the folder's, exactly (the tied lm_head is the embedding).
    trained_llm = part(result["after"], "llm.")
    hf_names = llm_adapter.state_dict_to_hf(trained_llm, llm_adapter.config_from_hf(llm.config))
    in_folder = load_file(llm_dir / "model.safetensors")
    assert hf_names.keys() == in_folder.keys()
    for name, value in in_folder.items():
        torch.testing.assert_close(hf_names[name], value, rtol=0, atol=0, msg=name)
    torch.testing.assert_close(trained_llm["layers.1.attn.q_proj.weight"],
                               llm.model.layers[1].self_attn.q_proj.weight.detach(), rtol=0, atol=0)

    # The ViT at step 0 is the tower's (merger renamed, Conv3d summed over its 2 frames), then trains.
    initial_vit = part(result["before"], "encoders.image.")
    trained_vit = part(result["after"], "encoders.image.")
    vit_cfg = vit_adapter.config_from_hf(vision.config)
    expected_vit = vit_adapter.state_dict_from_hf(vision.state_dict(), vit_cfg)
    assert initial_vit.keys() == expected_vit.keys()
    for name, value in expected_vit.items():
        torch.testing.assert_close(initial_vit[name], value, rtol=0, atol=0, msg=name)
    torch.testing.assert_close(initial_vit["merger.fc1.weight"], vision.merger.mlp[0].weight.detach(),
                               rtol=0, atol=0)
    torch.testing.assert_close(initial_vit["patch_embed.weight"],
                               vision.patch_embed.proj.weight.detach().sum(dim=2).flatten(1), rtol=0, atol=0)
    assert not torch.equal(trained_vit["merger.fc1.weight"], initial_vit["merger.fc1.weight"])

    # Text only, step 0: transformers' logits.
    with torch.no_grad():
        want = llm(torch.tensor([TEXT])).logits[0]
    assert want.abs().max() > 1.0, "logits too small for a meaningful tolerance"
    assert_parity(result["logits"], want, "result['logits']")


def _launch(capfd, recipe: Path, *overrides: str) -> tuple[int, str]:
    from veomni.launch import main

    status = main([str(recipe), *overrides])
    captured = capfd.readouterr()
    return status, captured.out + captured.err


def _tiny_vlm_llm_config(**changes) -> transformers.Qwen3Config:
    """The LLM of recipes/seed1.5-vl/tiny.yaml, with recipe-key ``changes``, as a Qwen3 config; read
    from the recipe so that the two cannot drift apart (config.json is all a pre-flight reads)."""
    recipe_llm = load_config(TINY_VLM).model.options["llm"]
    return llm_adapter.config_to_hf(LLMConfig(**{**recipe_llm, **changes}))


def _launch_tiny_vlm(capfd, tmp: Path, *overrides: str) -> tuple[int, str]:
    """The real launch's pre-flight on the tiny VLM recipe, with a tiny shard (nothing is built)."""
    return _launch(capfd, TINY_VLM, "--data.train_path", str(_vqa_shard(tmp / "vqa")), "--data.eval_path",
                   "null", "--data.prepare", "null", "--train.output_dir", str(tmp / "out"), *overrides)


def test_launcher_refuses_a_frozen_component_that_nothing_loads(tmp_path, capfd):
    status, output = _launch_tiny_vlm(capfd, tmp_path, "--model.freeze", "[llm]")
    assert status == 2, output
    assert "a frozen component that was never loaded trains nothing" in output
    assert "checkpoint.init.llm: /path/to/pretrained" in output and "model.freeze" in output

    _tiny_vlm_llm_config().save_pretrained(tmp_path / "llm")
    status, output = _launch_tiny_vlm(capfd, tmp_path, "--model.freeze", "[llm]",
                                      "--checkpoint.init.llm", str(tmp_path / "llm"))
    assert status == 0, output


def test_launcher_refuses_a_folder_whose_config_differs_naming_each_field(tmp_path, capfd):
    _tiny_vlm_llm_config(hidden_size=64, num_layers=2).save_pretrained(tmp_path / "llm")
    status, output = _launch_tiny_vlm(capfd, tmp_path, "--checkpoint.init.llm", str(tmp_path / "llm"))
    assert status == 2, output
    assert f"checkpoint.init.llm: {tmp_path / 'llm'} does not fit the recipe's 'llm' (LLMConfig)" in output
    assert "hidden_size: recipe 128, folder 64" in output and "num_layers: recipe 4, folder 2" in output
    assert "vocab_size" not in output  # only the fields that differ


def test_launcher_refuses_an_unknown_component_listing_the_valid_ones(tmp_path, capfd):
    status, output = _launch_tiny_vlm(capfd, tmp_path, "--checkpoint.init.vision", str(tmp_path))
    assert status == 2, output
    assert ("checkpoint.init.vision: the model has no sub-module 'vision'; "
            "its components: llm, encoders.image") in output


@pytest.mark.parametrize("recipe, flags", [
    ("seed1.5-vl/stage1_from_pretrained.yaml", ["--checkpoint.init.llm", "--checkpoint.init.encoders.image"]),
    ("audio/stage1_from_pretrained.yaml", ["--checkpoint.init.llm"]),
])
def test_stage1_recipes_refuse_missing_folders_in_a_dry_run_as_in_a_real_run(recipe, flags, tmp_path, capfd):
    missing = [str(tmp_path / f"missing-{i}") for i in range(len(flags))]
    paths = [arg for flag, path in zip(flags, missing) for arg in (flag, path)]
    for mode in (["--dry-run", "--world-size", "8", "--gpus"], []):
        status, output = _launch(capfd, REPO / "recipes" / recipe, *mode, "--train.output_dir",
                                 str(tmp_path / "out"), *paths)
        assert status == 2, output
        assert all(f"config error: {flag[2:]}: folder does not exist: {path}" in output
                   for flag, path in zip(flags, missing))
        assert "preparing data" not in output and "# plan" not in output  # no data is built, nothing planned


# ----- the engine alone: any family, a diffusers-style folder, safetensors in our own names ------------
@pytest.fixture(scope="module")
def toy_adapter():
    """An adapter for a diffusers-style ``config.json`` (``_class_name``, no ``model_type``)."""
    from dataclasses import make_dataclass

    config_cls = make_dataclass("ToyConfig", [("width", int), ("init_std", float, 0.02)])
    adapter = SimpleNamespace(
        hf_model_types=("ToyTestTransformer",), free_fields=("init_std",),
        config_from_hf=lambda contents: config_cls(width=contents["width"]),
        config_to_hf=None,
        state_dict_from_hf=lambda sd, cfg: {name.removeprefix("toy_"): t for name, t in sd.items()},
        state_dict_to_hf=None)
    register_hf_adapter(adapter)
    return config_cls


class _Toy(nn.Module):
    def __init__(self, config) -> None:
        super().__init__()
        self.config = config
        self.proj = nn.Linear(config.width, config.width)


def test_generic_components_from_a_diffusers_style_folder_and_from_our_own_names(toy_adapter, tmp_path):
    import json

    model = nn.ModuleDict({"denoiser": _Toy(toy_adapter(width=4)), "head": nn.Linear(4, 2)})
    weights = {"toy_proj.weight": torch.randn(4, 4), "toy_proj.bias": torch.randn(4)}
    (tmp_path / "toy").mkdir()
    config = {"_class_name": "ToyTestTransformer", "width": 4}
    (tmp_path / "toy" / "config.json").write_text(json.dumps(config))
    save_file(weights, tmp_path / "toy" / "diffusion_pytorch_model.safetensors")
    head = {"weight": torch.randn(2, 4), "bias": torch.randn(2)}
    (tmp_path / "head").mkdir()
    save_file(head, tmp_path / "head" / "model.safetensors")

    lines = load_components(model, {"denoiser": str(tmp_path / "toy"), "head": str(tmp_path / "head")})
    assert torch.equal(model["denoiser"].proj.weight, weights["toy_proj.weight"])
    assert torch.equal(model["head"].bias, head["bias"])
    assert lines == [f"'denoiser' initialised from {tmp_path / 'toy'} (Hugging Face folder, ToyConfig)",
                     f"'head' initialised from {tmp_path / 'head'} (safetensors in our parameter names)"]

    wider = nn.ModuleDict({"denoiser": _Toy(toy_adapter(width=8, init_std=0.5))})
    with pytest.raises(ValueError, match=r"does not fit the recipe's 'denoiser' \(ToyConfig\): "
                                         r"width: recipe 8, folder 4\. Set"):
        load_components(wider, {"denoiser": str(tmp_path / "toy")})
    with pytest.raises(ValueError, match=r"checkpoint\.init\.head: .* does not hold the parameters of "
                                         r"'head': missing none; unexpected extra"):
        save_file({**head, "extra": torch.zeros(1)}, tmp_path / "head" / "model.safetensors")
        load_components(model, {"head": str(tmp_path / "head")})
