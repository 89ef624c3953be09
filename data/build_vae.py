"""Build the tiny text-to-video recipe's VAE (stage 0): train it, export it, set its latent scaling.

Why: the tiny recipe runs offline, so it cannot download a VAE; it trains a small diffusers
``AutoencoderKL`` with the engine itself (``recipes/goku/tiny_vae.yaml``) and publishes it where
the latent precompute reads it:

    python data/build_vae.py [--out data/cache/video/vae] [--recipe recipes/goku/tiny_vae.yaml] [--section.key V ...]

Other ``--section.key value`` options override the recipe, for the training and for this script.

1. Training runs through ``scripts/train.sh RECIPE`` (which prepares the clips and launches the
   ranks) unless the recipe's output folder already holds a checkpoint of its last step (an
   interrupted run resumes from its newest checkpoint).
2. The newest checkpoint becomes an ``AutoencoderKL`` (``export_checkpoint``; also
   ``python data/build_vae.py --export CHECKPOINT --out DIR`` for any ``vae`` checkpoint).
3. ``shift_factor`` and ``scaling_factor`` are set to the mean and 1 / std of the posterior means
   of every frame of up to ``--clips`` training clips (whole frames, as the precompute encodes
   them), so ``(z - shift_factor) * scaling_factor`` has zero mean and unit std; the eval
   frames' reconstruction PSNR is printed.
4. The folder is written aside and renamed into place (``save_pretrained`` files plus nothing
   else); once there, later calls return at once. A file lock lets concurrent callers wait for
   one builder.
"""

from __future__ import annotations

import argparse
import fcntl
import json
import math
import os
import subprocess
import sys
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from models.vae.diffusers_io import build_diffusers_vae, save_atomically  # noqa: E402
from veomni.checkpoint.export import load_checkpoint_weights  # noqa: E402
from veomni.checkpoint.manager import list_checkpoints  # noqa: E402
from veomni.config.load import load_config  # noqa: E402
from veomni.data.sources import ReadStats, iter_tar_samples, resolve_files  # noqa: E402
from veomni.data.video.clip_format import CorruptClipError, decode_clip  # noqa: E402
from veomni.train.report.summary import STAGE_ENV  # noqa: E402

DEFAULT_RECIPE = REPO / "recipes" / "goku" / "tiny_vae.yaml"
DEFAULT_OUT = REPO / "data" / "cache" / "video" / "vae"


def clip_frames(split: Path, limit: int) -> list[torch.Tensor]:
    """The frames of each of the first ``limit`` good clips of a split: [F, 3, H, W] in [-1, 1]."""
    _, files = resolve_files(str(split), "webdataset")
    clips = []
    for record in iter_tar_samples(files, max_bad_fraction=1.0, stats=ReadStats()):
        try:
            frames = decode_clip(record).frames
        except CorruptClipError:
            continue
        clips.append(torch.from_numpy(frames).permute(0, 3, 1, 2).float() / 127.5 - 1)
        if len(clips) == limit:
            break
    if not clips:
        raise ValueError(f"{split} holds no readable clip")
    return clips


@torch.no_grad()
def latent_statistics(vae, clips: list[torch.Tensor]) -> tuple[float, float]:
    """(mean, std) over every element of the posterior means of ``clips``' frames."""
    count, total, squares = 0, 0.0, 0.0
    for frames in clips:
        z = vae.encode(frames).latent_dist.mean.double()
        count, total, squares = count + z.numel(), total + float(z.sum()), squares + float((z**2).sum())
    mean = total / count
    return mean, math.sqrt(max(squares / count - mean * mean, 1e-12))


@torch.no_grad()
def reconstruction_psnr(vae, clips: list[torch.Tensor]) -> float:
    """PSNR in dB of the posterior-mean reconstructions (pixel range [-1, 1], so peak 2)."""
    errors, count = 0.0, 0
    for frames in clips:
        reconstruction = vae.decode(vae.encode(frames).latent_dist.mean).sample.clamp(-1, 1)
        errors, count = errors + float(((reconstruction - frames) ** 2).sum()), count + frames.numel()
    return 10 * math.log10(4 / (errors / count))


def export_checkpoint(checkpoint: Path, out: Path | None = None):
    """``(run config, AutoencoderKL)`` of a ``vae`` run's ``step_*`` checkpoint (any world size or
    FSDP layout wrote it); also written to ``out`` when given."""
    run_cfg, model_cfg, state_dict = load_checkpoint_weights(checkpoint)
    if run_cfg.model.arch != "vae":
        raise ValueError(f"{checkpoint} is a {run_cfg.model.arch!r} checkpoint, not a 'vae' one")
    vae = build_diffusers_vae(state_dict, model_cfg)
    if out is not None:
        save_atomically(vae, out)
    return run_cfg, vae


def finished_checkpoint(output_dir: Path, max_steps: int) -> Path | None:
    """The run's checkpoint of step ``max_steps`` (or later), None while training is not done."""
    found = list_checkpoints(output_dir / "checkpoints")
    return found[-1][1] if found and found[-1][0] >= max_steps else None


def build(recipe: Path, out: Path, clips: int, overrides: list[str]) -> None:
    run_cfg = load_config(recipe, overrides)
    output_dir = Path(run_cfg.train.output_dir)
    checkpoint = finished_checkpoint(output_dir, run_cfg.train.max_steps)
    if checkpoint is None:  # a fresh run, or one stopped early (resumed by the launcher's resume: auto)
        print(f"[build_vae] training {recipe} (stage 0)", flush=True)
        train = ["bash", str(REPO / "scripts" / "train.sh"), str(recipe), *overrides]
        stage = {STAGE_ENV: f"stage 0 of 2 (the VAE; the text-to-video run follows), {recipe.name}"}
        if subprocess.run(train, cwd=REPO, env={**os.environ, **stage}).returncode != 0:
            sys.exit(f"[build_vae] training {recipe} failed (its output is above)")
        checkpoint = finished_checkpoint(output_dir, run_cfg.train.max_steps)
        if checkpoint is None:  # a requested stop (SIGTERM, Ctrl-C) exits 0 with a checkpoint before max_steps
            sys.exit(f"[build_vae] stage 0 stopped before step {run_cfg.train.max_steps}: run the same command "
                     "again to resume it")
    _, vae = export_checkpoint(checkpoint)
    shift, std = latent_statistics(vae, clip_frames(Path(run_cfg.data.train_path), clips))
    vae.register_to_config(shift_factor=shift, scaling_factor=1.0 / std)
    if run_cfg.data.eval_path:
        psnr = reconstruction_psnr(vae, clip_frames(Path(run_cfg.data.eval_path), clips))
        print(f"[build_vae] eval frames: reconstruction PSNR {psnr:.2f} dB", flush=True)
    save_atomically(vae, out)
    print(f"[build_vae] {checkpoint} -> {out} (shift_factor {shift:.4f}, scaling_factor {1.0 / std:.4f})")


def is_built(out: Path) -> bool:
    try:
        return json.loads((out / "config.json").read_text()).get("_class_name") == "AutoencoderKL"
    except (OSError, ValueError):
        return False


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--recipe", type=Path, default=DEFAULT_RECIPE)
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT)
    parser.add_argument("--clips", type=int, default=512, help="training clips the latent statistics read")
    parser.add_argument("--export", type=Path, default=None, metavar="CHECKPOINT",
                        help="only write this checkpoint to --out as it is (no training, no latent scaling)")
    args, overrides = parser.parse_known_args(argv)
    if args.export is not None:
        export_checkpoint(args.export, args.out)
        print(f"exported {args.export} -> {args.out}")
        return
    if is_built(args.out):
        print(f"cached: {args.out}")
        return
    args.out.parent.mkdir(parents=True, exist_ok=True)
    with open(args.out.parent / f".{args.out.name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if is_built(args.out):
            print(f"cached: {args.out}")
            return
        build(args.recipe.resolve(), args.out.resolve(), args.clips, overrides)


if __name__ == "__main__":
    main()
