"""The video DiT through the real trainer, from raw clips: clips -> a frozen VAE and text encoder ->
precomputed latents -> packed rows -> rectified-flow training on 2 gloo ranks with a weight EMA and
validation samples; a run resumed from its checkpoint continues with exactly the losses of an
uninterrupted one (data position, task randomness and EMA restored)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from harness.gloo_ranks import run_distributed
from tests.builders.test_video_latents_builder import DATA, tiny_vae
from veomni.config.schema import (
    CheckpointConfig,
    DataConfig,
    LogConfig,
    ModelConfig,
    ParallelConfig,
    RunConfig,
    TrainConfig,
)
from veomni.data.builders import load_script
from veomni.train.trainer import Trainer

pytestmark = pytest.mark.full  # whole runs / multi-rank trainers: the full tier (tests/conftest.py)

TINY = dict(num_layers=2, num_attention_heads=2, attention_head_dim=16, ffn_dim=64, in_channels=4, out_channels=4,
            text_dim=64, freq_dim=32, patch_size=[1, 2, 2], shift_base_tokens=64, text_len=8)


@pytest.fixture(scope="module")
def latents(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("video")
    shapes = load_script(DATA / "build_moving_shapes.py")
    shapes.build(root / "clips" / "train", root / "clips" / "eval", 7, train_samples=48, eval_samples=12)
    tiny_vae("kl").save_pretrained(root / "vae")
    precompute = load_script(DATA / "build_video_latents.py")
    precompute.build(root / "clips", root / "vae", root / "text_encoder", root / "latents" / "train",
                     root / "latents" / "eval", batch_frames=64)
    return root / "latents"


def config(latents: Path, out: Path, model: dict | None = None, **train) -> RunConfig:
    return RunConfig(
        model=ModelConfig(arch="dit", options={**TINY, **(model or {})}),
        data=DataConfig(train_path=str(latents / "train"), eval_path=str(latents / "eval"),
                        tokens_per_micro_batch=400),
        parallel=ParallelConfig(),
        train=TrainConfig(output_dir=str(out), max_steps=4, seed=5, lr=2e-3, warmup_steps=1, eval_batches=2,
                          device="cpu", ema_decay=0.9, sample_interval=2, **train),
        checkpoint=CheckpointConfig(interval=2, keep_last=3),
        log=LogConfig(progress_bar=False),
    )


def _uninterrupted(rank, world, latents, out):
    history = Trainer(config(Path(latents), Path(out))).train()
    return [m["loss"] for m in history], history[-1]


def _crash_after_2_then_resume(rank, world, latents, out):
    first = Trainer(config(Path(latents), Path(out)))
    for _ in range(2):
        first.run_step()  # checkpoint.interval=2 saves here
    del first
    second = Trainer(config(Path(latents), Path(out)))
    assert second.step == 2
    return [m["loss"] for m in second.train()]


def test_dit_trains_from_clips_writes_samples_and_resumes_exactly(latents, tmp_path):
    losses, last = run_distributed(_uninterrupted, 2, str(latents), str(tmp_path / "a"))[0]
    assert all(torch.isfinite(torch.tensor(losses)))
    assert last["latent_tokens"] > 0 and last["loss_latent_tokens"] == last["latent_tokens"]
    assert last["latent_tokens_per_s"] > 0 and 0 < last["mfu"] < 1
    sheets = sorted((tmp_path / "a" / "samples").glob("samples_step_*.png"))
    assert [p.name for p in sheets] == ["samples_step_00000002.png", "samples_step_00000004.png"]
    summary = json.loads((tmp_path / "a" / "summary.json").read_text())
    assert summary["unit"] == "latent_token" and summary["baseline"]["name"] == "the mean velocity alone"
    resumed = run_distributed(_crash_after_2_then_resume, 2, str(latents), str(tmp_path / "b"))[0]
    assert resumed == losses[2:], "resumed losses differ from the uninterrupted run"


def _first_frame_conditioned(rank, world, latents, out):
    run = config(Path(latents), Path(out), {"first_frame_probability": 1.0})
    run.train.max_steps = 2
    history = Trainer(run).train()
    return [m["loss"] for m in history], history[-1]


def test_first_frame_conditioning_trains_on_todays_latents_without_the_first_frames_in_the_loss(latents, tmp_path):
    """Every clip conditioned on its first frame (the bundled clips have more than one latent
    frame; images have one and stay unconditioned): the first frames' tokens run through the model
    but leave the loss, so the step's loss tokens are fewer than its latent tokens."""
    losses, last = run_distributed(_first_frame_conditioned, 1, str(latents), str(tmp_path / "c"))[0]
    assert all(torch.isfinite(torch.tensor(losses)))
    assert 0 < last["loss_latent_tokens"] < last["latent_tokens"]
