"""Sample clips for prompts with a trained DiT and write them out (GIFs and a contact sheet).

    bash scripts/sample.sh RUN_DIR --prompt "a red circle moves left" [--prompt ...] [--steps 30]
        [--guidance 4] [--seed 0] [--frames 9] [--height 32] [--width 32] [--out DIR]
        [--checkpoint STEP_DIR] [--no-ema] [--device cpu|cuda] [--image FRAME.png [--image ...]]

``--image`` (image-to-video): the clip starts from that frame (one image for every prompt, or one
per prompt); its size is the clip's (``--height`` / ``--width`` may be left out and must agree when
given). For a model trained with ``model.first_frame_probability`` > 0 (Wan2.2 form) its latent is
held at frame 0; a conditioning-channel model (Wan2.1 I2V, ``in_channels`` > ``out_channels``)
reads its conditioning channels and, with ``image_dim``, its image-encoder states, built as the
latent precompute built them (``models/dit/image_to_video.py``), and needs ``--image``.

The zoo cannot read checkpoints (the engine owns them), so ``main`` takes the weight loader as an
argument: ``scripts/sample.py`` passes the engine's, which prefers the checkpoint's EMA weights;
likewise the first-frame conditioner of a conditioning-channel model (it loads the engine's VAE
and image encoders).
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
from PIL import Image

from models.dit.image_to_video import FirstFrameConditioner, is_conditioned
from models.dit.media import write_contact_sheet, write_gif
from models.dit.task import diffusion_task
from models.dit.text_to_video import VideoPipeline
from veomni.contract import get_model_spec

WeightLoader = Callable[[Path, Path | None, bool], tuple[Any, Any, dict[str, torch.Tensor], Path]]
"""``(run_dir, checkpoint or None for the newest, prefer_ema) -> (run config, model config, state dict,
checkpoint path)``."""
ConditionerLoader = Callable[[str, Any, str], FirstFrameConditioner]
"""``(latent split path, model config, device) -> conditioner`` of a conditioning-channel model."""


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
        parser.add_argument("--height", type=int, default=None, help=f"pixels (default {default.height})")
        parser.add_argument("--width", type=int, default=None, help=f"pixels (default {default.width})")
    parser.add_argument("--steps", type=int, default=default.steps, help="sampler steps")
    parser.add_argument("--guidance", type=float, default=default.guidance, help="classifier-free guidance scale")
    parser.add_argument("--seed", type=int, default=default.seed)
    parser.add_argument("--checkpoint", type=Path, default=None, help="a step_* folder (default: the newest)")
    parser.add_argument("--no-ema", action="store_true", help="use the trained weights even if an EMA exists")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")


def settings_from(args: argparse.Namespace, first_frames: np.ndarray | None = None) -> SampleSettings:
    """The sampler's settings; the clip's height and width are the first frames' when there are any."""
    default = SampleSettings()
    height, width = args.height or default.height, args.width or default.width
    if first_frames is not None:
        size = first_frames.shape[1:3]
        if (args.height or size[0], args.width or size[1]) != tuple(size):
            raise ValueError(f"--height {args.height} --width {args.width}: the first frames are {size[0]} x "
                             f"{size[1]} pixels, which is the clip's size; leave both out")
        height, width = size
    return SampleSettings(args.frames, height, width, args.steps, args.guidance, args.seed)


def read_first_frames(paths: list[Path] | None, prompts: int) -> np.ndarray | None:
    """uint8 [prompts, H, W, 3] from ``--image`` files (one for every prompt, or one per prompt), or None."""
    if not paths:
        return None
    if len(paths) not in (1, prompts):
        raise ValueError(f"{len(paths)} --image files for {prompts} prompts: give one image, or one per prompt")
    frames = []
    for path in paths:
        with Image.open(path) as image:
            frames.append(np.asarray(image.convert("RGB")))
    if len({frame.shape for frame in frames}) > 1:
        raise ValueError(f"the --image files differ in size ({sorted({f.shape[:2] for f in frames})}): one clip "
                         "size per call")
    return np.stack(frames * (prompts if len(frames) == 1 else 1))


def pipeline_from_weights(arch: str, model_config: Any, state_dict: dict[str, torch.Tensor], train_path: str,
                          device: str | torch.device,
                          conditioner: FirstFrameConditioner | None = None) -> VideoPipeline:
    """A sampling pipeline for the ``arch`` model with ``state_dict``, on the VAE and text encoder of
    the latent split at ``train_path``."""
    model = get_model_spec(arch).instantiate(model_config)
    model.load_state_dict(state_dict)
    model.to(device).eval()
    return VideoPipeline.from_latent_manifest(model, diffusion_task(model_config), model_config.patch_size,
                                              train_path, device, conditioner)


def write_samples(pipeline: VideoPipeline, prompts: list[str], settings: SampleSettings, out_dir: Path,
                  first_frames: np.ndarray | None = None) -> tuple[list[Path], Path, np.ndarray]:
    """Sample ``prompts`` (from ``first_frames`` [B, H, W, 3] when given) and write one GIF each and a
    contact sheet: (GIF paths, sheet path, clips)."""
    clips = pipeline.generate(prompts, settings.frames, settings.height, settings.width, settings.steps,
                              settings.guidance, settings.seed, first_frames)
    gifs = [write_gif(clip, out_dir / f"sample_{i:02d}.gif") for i, clip in enumerate(clips)]
    sheet = write_contact_sheet(list(clips), prompts, out_dir / "contact_sheet.png")
    return gifs, sheet, clips


def check_image_arguments(model_config: Any, has_image: bool, run_dir: Path) -> None:
    """``--image`` for a model that can start from a frame, and always for one that reads conditioning channels."""
    conditioned = is_conditioned(model_config)
    if conditioned and not has_image:
        raise ValueError(f"the model of {run_dir} reads conditioning channels (Wan2.1 image-to-video, in_channels "
                         f"{model_config.in_channels} > out_channels {model_config.out_channels}): give its first "
                         "frame with --image FRAME.png")
    if has_image and not conditioned and model_config.first_frame_probability <= 0:
        raise ValueError(f"--image: the model of {run_dir} was trained without first-frame conditioning "
                         "(model.first_frame_probability 0), so it cannot start from a given frame; train "
                         "with model.first_frame_probability > 0 (recipes/goku/tiny_i2v.yaml)")


def main(argv: list[str] | None, load_weights: WeightLoader, load_conditioner: ConditionerLoader | None = None) -> int:
    parser = argparse.ArgumentParser(prog="sample", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("run_dir", type=Path, help="the run's train.output_dir")
    parser.add_argument("--prompt", action="append", required=True, help="a caption; repeat for several")
    parser.add_argument("--out", type=Path, default=None, help="output folder")
    parser.add_argument("--image", type=Path, action="append", default=None,
                        help="a first frame (PNG, ...): image-to-video; one for every prompt, or one per prompt")
    add_sample_arguments(parser)
    args = parser.parse_args(argv)
    try:
        first_frames = read_first_frames(args.image, len(args.prompt))
        settings = settings_from(args, first_frames)
        run_cfg, model_cfg, state, checkpoint = load_weights(args.run_dir, args.checkpoint, not args.no_ema)
        check_image_arguments(model_cfg, first_frames is not None, args.run_dir)
        conditioner = None
        if is_conditioned(model_cfg) and load_conditioner is not None:
            conditioner = load_conditioner(run_cfg.data.train_path, model_cfg, args.device)
        pipeline = pipeline_from_weights(run_cfg.model.arch, model_cfg, state, run_cfg.data.train_path, args.device,
                                         conditioner)
        out_dir = args.out or args.run_dir / "samples" / checkpoint.name
        gifs, sheet, _ = write_samples(pipeline, args.prompt, settings, out_dir, first_frames)
    except (FileNotFoundError, ValueError) as exc:
        print(f"sample error: {exc}", file=sys.stderr)
        return 2
    for prompt, gif in zip(args.prompt, gifs):
        print(f"{gif}  {prompt}")
    print(sheet)
    return 0
