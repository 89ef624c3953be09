"""The Wan2.1 image-to-video form through the real trainer, from raw clips: a latent cache built
with ``--condition`` and ``--image-encoder`` (a CLIPVisionModel folder built here from config) feeds
a DiT with conditioning channels and an image branch, whose every weight the steps change, and
whose validation samples (from the held-out cache's first frames) are written."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch.distributed.tensor import DTensor

from harness.gloo_ranks import run_distributed
from tests.builders.test_video_latents_builder import DATA, tiny_vae
from tests.train.test_dit_trainer import config
from veomni.data.builders import load_script
from veomni.train.trainer import Trainer

pytestmark = pytest.mark.full  # whole runs / multi-rank trainers: the full tier (tests/conftest.py)

# a per-frame VAE (temporal factor 1): 1 mask channel + 4 condition channels beside the 4 noisy ones
I2V = {"in_channels": 9, "image_dim": 24, "added_kv_proj_dim": 32}


@pytest.fixture(scope="module")
def latents(tmp_path_factory) -> Path:
    from transformers import CLIPImageProcessor, CLIPVisionConfig, CLIPVisionModel

    root = tmp_path_factory.mktemp("video_i2v")
    shapes = load_script(DATA / "build_moving_shapes.py")
    shapes.build(root / "clips" / "train", root / "clips" / "eval", 7, train_samples=24, eval_samples=8)
    tiny_vae("kl").save_pretrained(root / "vae")
    CLIPVisionModel(CLIPVisionConfig(hidden_size=24, intermediate_size=32, num_hidden_layers=2, num_attention_heads=2,
                                     image_size=16, patch_size=8)).save_pretrained(root / "clip")
    CLIPImageProcessor(size={"shortest_edge": 16}, crop_size={"height": 16, "width": 16}).save_pretrained(root / "clip")
    builder = load_script(DATA / "build_video_latents.py")
    builder.build(root / "clips", root / "vae", root / "text_encoder", root / "latents" / "train",
                  root / "latents" / "eval", batch_frames=64, conditioning=builder.Conditioning(True, root / "clip"))
    return root / "latents"


def _image_branch(model) -> dict[str, torch.Tensor]:
    return {name: (param.full_tensor() if isinstance(param, DTensor) else param).detach().clone()
            for name, param in model.named_parameters()
            if "image_embedder" in name or "add_k_proj" in name or "add_v_proj" in name}


def _train(rank, world, latents, out):
    run = config(Path(latents), Path(out), I2V)
    run.train.max_steps, run.train.sample_interval = 3, 3
    trainer = Trainer(run)
    before = _image_branch(trainer.model)
    history = trainer.train()
    after = _image_branch(trainer.model)
    sheets = sorted(p.name for p in (Path(out) / "samples").glob("*.png"))
    return [m["loss"] for m in history], {name: float((after[name] - before[name]).abs().max()) for name in before}, \
        sheets


def test_the_wan21_form_trains_on_a_cache_with_first_frame_conditioning(latents, tmp_path):
    losses, moved, sheets = run_distributed(_train, 1, str(latents), str(tmp_path / "run"))[0]
    assert len(losses) == 3 and all(torch.isfinite(torch.tensor(losses)))
    assert moved and all(value > 0 for value in moved.values()), moved  # proj_out starts at zero: step 1 moves it
    assert sheets == ["samples_step_00000003.png"]
