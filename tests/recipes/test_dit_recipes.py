"""The video DiT recipes at the papers' sizes plan with --dry-run, with the parameter count of
Wan's block at those widths (counted by hand here), and refuse a sequence-parallel size the
heads do not divide before any worker starts; the Wan2.1-I2V-14B recipe plans with diffusers'
own parameter count."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import torch
from diffusers import WanTransformer3DModel

from models.dit.config import ARCHITECTURE_FIELDS
from tests.launch.test_launch import REPO, dry_run
from veomni.config.load import load_config
from veomni.data.builders import MANIFEST

pytestmark = pytest.mark.full  # whole runs / multi-rank trainers: the full tier (tests/conftest.py)


def wan_parameters(o: dict) -> int:
    """Parameters of diffusers' WanTransformer3DModel (text-to-video) at these widths."""
    d, f, text = o["num_attention_heads"] * o["attention_head_dim"], o["ffn_dim"], o["text_dim"]
    patch = o["patch_size"][0] * o["patch_size"][1] * o["patch_size"][2]
    attention = 4 * (d * d + d) + 2 * d  # q, k, v, out with biases; q/k RMSNorm across heads
    block = 2 * attention + 2 * d + (d * f + f + f * d + d) + 6 * d  # self, cross, norm2, FFN, table
    embed = o["in_channels"] * patch * d + d
    time = o["freq_dim"] * d + d + d * d + d + d * 6 * d + 6 * d
    caption = text * d + d + d * d + d
    head = 2 * d + d * o["out_channels"] * patch + o["out_channels"] * patch
    return o["num_layers"] * block + embed + time + caption + head


def user_latents(folder: Path, text_dim: int) -> Path:
    """What the launcher reads of a user's 720p latents (data/build_video_latents.py's manifest): 16
    channels, 21 x 90 x 160 per clip (75,600 patches of 1x2x2), text states ``text_dim`` wide."""
    folder.mkdir(parents=True)
    (folder / MANIFEST).write_text(json.dumps({"latent_channels": 16, "text_dim": text_dim,
                                               "shapes": ["16x21x90x160"], "example_keys": {}}))
    return folder


@pytest.mark.parametrize("recipe, world, sp", [
    ("goku/goku_2b.yaml", 64, 4), ("goku/goku_8b.yaml", 128, 8), ("seaweed/seaweed_7b.yaml", 256, 4)])
def test_full_size_recipes_plan(recipe, world, sp, tmp_path, capfd):
    path = REPO / "recipes" / recipe
    if recipe == "goku/goku_2b.yaml":  # the README's command, in a fresh clone: planned without the latents
        absent = dry_run(capfd, str(path), "--world-size", str(world), "--gpus")
        assert absent.returncode == 0 and "# plan" in absent.stdout, absent.stderr
        assert re.search(r"dry run: absent here.*data\.train_path.*Skipped until they exist", absent.stderr)
    latents = user_latents(tmp_path / "latents", load_config(path).model.options["text_dim"])
    result = dry_run(capfd, str(path), "--world-size", str(world), "--gpus", "--data.train_path", str(latents))
    assert result.returncode == 0, result.stderr
    out = result.stdout
    assert f"sp={sp} (Ulysses)" in out
    total = int(re.search(r"parameters +([\d,]+)", out).group(1).replace(",", ""))
    assert total == wan_parameters(load_config(path).model.options)
    assert "75,600 patch tokens" in out and "GFLOP per latent_token" in out
    memory = float(re.search(r"  total +([\d.]+)", out).group(1))
    assert 1.0 < memory < 70.0, "the plan must fit an 80 GB GPU"


def test_sequence_parallel_size_must_divide_the_heads(capfd):
    result = dry_run(capfd, str(REPO / "recipes" / "goku" / "goku_2b.yaml"), "--world-size", "64", "--gpus",
                     "--parallel.sp", "8")
    assert result.returncode == 2
    assert "parallel.sp=8 does not divide the 28 attention heads" in result.stderr
    assert "Traceback" not in result.stderr


def test_wan_i2v_14b_recipe_plans_with_diffusers_parameter_count(capfd):
    """The published Wan2.1-I2V-14B shape: the plan's parameter count is diffusers' own
    ``WanTransformer3DModel`` built from the recipe's fields (on the meta device, no weights), and
    the FLOPs count the image tokens. Planned as the README's command runs it, without latents."""
    path = REPO / "recipes" / "wan" / "wan21_i2v_14b.yaml"
    options = load_config(path).model.options
    with torch.device("meta"):
        reference = WanTransformer3DModel(**{key: options[key] for key in ARCHITECTURE_FIELDS if key in options})
    result = dry_run(capfd, str(path), "--world-size", "64", "--gpus")
    assert result.returncode == 0, result.stderr
    out = result.stdout
    assert "sp=8 (Ulysses)" in out
    assert int(re.search(r"parameters +([\d,]+)", out).group(1).replace(",", "")) == sum(
        p.numel() for p in reference.parameters())
    assert "512-token caption and 257 image tokens" in out
    memory = float(re.search(r"  total +([\d.]+)", out).group(1))
    assert 1.0 < memory < 70.0, "the plan must fit an 80 GB GPU"
