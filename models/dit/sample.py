"""Sample clips for prompts with a trained DiT and write them out (GIFs and a contact sheet).

    bash scripts/sample.sh RUN_DIR --prompt "a red circle moves left" [--prompt ...] [--steps 30]
        [--guidance 4] [--seed 0] [--frames 9] [--height 32] [--width 32] [--out DIR]
        [--checkpoint STEP_DIR] [--no-ema] [--device cpu|cuda]

The zoo cannot read checkpoints (the engine owns them), so ``main`` takes the weight loader as an
argument: ``scripts/sample.py`` passes the engine's, which prefers the checkpoint's EMA weights.
Writes ``DIR/sample_XX.gif`` per prompt and ``DIR/contact_sheet.png`` (rows = prompts, columns =
frames), and prints their paths. ``DIR`` defaults to ``RUN_DIR/samples/<checkpoint name>``.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from models.dit.media import write_contact_sheet, write_gif
from models.dit.task import diffusion_task
from models.dit.text_to_video import VideoPipeline
from veomni.contract import get_model_spec

WeightLoader = Callable[[Path, Path | None, bool], tuple[Any, Any, dict[str, torch.Tensor], Path]]
"""``(run_dir, checkpoint or None for the newest, prefer_ema) -> (run config, model config, state dict,
checkpoint path)``."""


@dataclass(frozen=True)
class SampleSettings:
    frames: int = 9
    height: int = 32
    width: int = 32
    steps: int = 30
    guidance: float = 4.0
    seed: int = 0


def add_sample_arguments(parser: argparse.ArgumentParser, sizes: bool = True) -> None:
    """The sampler's options (``SampleSettings``; the clip size only with ``sizes``), shared by every
    command that samples."""
    default = SampleSettings()
    if sizes:
        parser.add_argument("--frames", type=int, default=default.frames)
        parser.add_argument("--height", type=int, default=default.height, help="pixels")
        parser.add_argument("--width", type=int, default=default.width, help="pixels")
    parser.add_argument("--steps", type=int, default=default.steps, help="sampler steps")
    parser.add_argument("--guidance", type=float, default=default.guidance, help="classifier-free guidance scale")
    parser.add_argument("--seed", type=int, default=default.seed)
    parser.add_argument("--checkpoint", type=Path, default=None, help="a step_* folder (default: the newest)")
    parser.add_argument("--no-ema", action="store_true", help="use the trained weights even if an EMA exists")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")


def settings_from(args: argparse.Namespace) -> SampleSettings:
    return SampleSettings(args.frames, args.height, args.width, args.steps, args.guidance, args.seed)


def pipeline_from_weights(arch: str, model_config: Any, state_dict: dict[str, torch.Tensor], train_path: str,
                          device: str | torch.device) -> VideoPipeline:
    """A sampling pipeline for the ``arch`` model with ``state_dict``, on the VAE and text encoder of
    the latent split at ``train_path``."""
    model = get_model_spec(arch).instantiate(model_config)
    model.load_state_dict(state_dict)
    model.to(device).eval()
    return VideoPipeline.from_latent_manifest(model, diffusion_task(model_config), model_config.patch_size,
                                              train_path, device)


def write_samples(pipeline: VideoPipeline, prompts: list[str], settings: SampleSettings,
                  out_dir: Path) -> tuple[list[Path], Path, np.ndarray]:
    """Sample ``prompts`` and write one GIF each and a contact sheet: (GIF paths, sheet path, clips)."""
    clips = pipeline.generate(prompts, settings.frames, settings.height, settings.width, settings.steps,
                              settings.guidance, settings.seed)
    gifs = [write_gif(clip, out_dir / f"sample_{i:02d}.gif") for i, clip in enumerate(clips)]
    sheet = write_contact_sheet(list(clips), prompts, out_dir / "contact_sheet.png")
    return gifs, sheet, clips


def main(argv: list[str] | None, load_weights: WeightLoader) -> int:
    parser = argparse.ArgumentParser(prog="sample", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("run_dir", type=Path, help="the run's train.output_dir")
    parser.add_argument("--prompt", action="append", required=True, help="a caption; repeat for several")
    parser.add_argument("--out", type=Path, default=None, help="output folder")
    add_sample_arguments(parser)
    args = parser.parse_args(argv)
    try:
        run_cfg, model_cfg, state, checkpoint = load_weights(args.run_dir, args.checkpoint, not args.no_ema)
        pipeline = pipeline_from_weights(run_cfg.model.arch, model_cfg, state, run_cfg.data.train_path, args.device)
        out_dir = args.out or args.run_dir / "samples" / checkpoint.name
        gifs, sheet, _ = write_samples(pipeline, args.prompt, settings_from(args), out_dir)
    except (FileNotFoundError, ValueError) as exc:
        print(f"sample error: {exc}", file=sys.stderr)
        return 2
    for prompt, gif in zip(args.prompt, gifs):
        print(f"{gif}  {prompt}")
    print(sheet)
    return 0
