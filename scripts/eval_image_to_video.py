"""Image-to-video on held-out moving shapes: does the generated clip start from the given frame and
move as its caption says? Against a text-to-video model and a copied-frame baseline.

    bash scripts/eval_image_to_video.sh I2V_RUN T2V_RUN [--limit 64] [--clips data/cache/video/moving_shapes]
        [--steps 30] [--guidance 4] [--seed 0] [--no-ema] [--out DIR]

Each of the first ``--limit`` moving eval clips (held-out attribute combinations) gives its first
frame and its caption. Four clips are judged against that ground-truth clip:

- **I2V**: the I2V run (``model.first_frame_probability`` > 0) sampled from the first frame and the caption;
- **T2V**: the T2V run sampled from the caption alone (same seed and sampler);
- **copied frame**: the given frame repeated (a perfect first frame, no motion);
- **ground truth through the VAE**: the clip's latent decoded (what any DiT on these latents can reach).

Measures, from pixels only: PSNR of frame 0 against the given frame; PSNR of frames 1.. against the
ground truth's; the distance in pixels between the shape's centroid (the foreground of
``data/moving_shapes_analysis.py``) and the ground truth's, averaged over frames 1..; and the share
of clips whose motion the analyser (fitted on train clips only) reads as the caption's direction, a
clip whose centroid moves under ``STILL_PX`` per frame counting as still (wrong). Writes ``scores.json``
and a contact sheet (rows: ground truth, I2V, T2V per clip) to ``--out`` (default ``I2V_RUN/image_to_video``).
"""

from __future__ import annotations

import argparse
import json
import sys
from collections import defaultdict
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "data"))
sys.path.insert(0, str(REPO / "scripts"))
from eval_prompt_following import DEFAULT_CLIPS, FIT_CLIPS, read_clips, read_latents, run_eval  # noqa: E402
from moving_shapes_analysis import ShapesAnalyser, clip_features, foreground  # noqa: E402

from models.dit.media import write_contact_sheet  # noqa: E402
from models.dit.sample import pipeline_from_weights  # noqa: E402
from veomni.checkpoint.export import load_run_weights  # noqa: E402

STILL_PX = 0.25
"""Least median centroid step (pixels per frame) read as motion; the slow speed is 1 px per frame at 32 px."""
SETTINGS = ("I2V", "T2V", "copied frame", "ground truth through the VAE")


def psnr(a: np.ndarray, b: np.ndarray) -> float:
    """Peak signal-to-noise ratio of two uint8 images in dB (capped at 100 for equal images)."""
    mse = float(np.mean((a.astype(np.float64) - b.astype(np.float64)) ** 2))
    return 100.0 if mse == 0 else float(10 * np.log10(255.0**2 / mse))


def centroid(frame: np.ndarray) -> np.ndarray | None:
    mask = foreground(frame)
    return np.argwhere(mask).mean(axis=0) if mask.any() else None


def judge(clip: np.ndarray, truth: np.ndarray, meta: dict, analyser: ShapesAnalyser) -> dict[str, float]:
    """The measures of one generated clip against its ground truth (module docstring)."""
    errors = []
    for frame, true_frame in zip(clip[1:], truth[1:]):
        found, wanted = centroid(frame), centroid(true_frame)
        errors.append(min(truth.shape[1:3]) / 2 if found is None else float(np.linalg.norm(found - wanted)))
    features = clip_features(clip)
    moving = features is not None and np.linalg.norm(features.step) * min(clip.shape[1:3]) >= STILL_PX
    direction = analyser.analyse(clip)["direction"] if moving else "still"
    return {"first_frame_psnr": psnr(clip[0], truth[0]),
            "later_frames_psnr": float(np.mean([psnr(f, t) for f, t in zip(clip[1:], truth[1:])])),
            "centroid_error_px": float(np.mean(errors)), "direction_right": float(direction == meta["direction"])}


def _identity(meta: dict) -> str:
    """A clip's json without what the latent precompute adds: matches a latent sample to its clip."""
    return json.dumps({k: v for k, v in meta.items() if k != "latent_shape"}, sort_keys=True)


def generate(pipeline, clips: list[tuple[np.ndarray, dict]], args, from_first_frame: bool) -> list[np.ndarray]:
    """One clip per held-out clip at its size, clips of one size in one call."""
    by_size: dict[tuple, list[int]] = defaultdict(list)
    for i, (frames, _) in enumerate(clips):
        by_size[frames.shape[:3]].append(i)
    out: list[np.ndarray | None] = [None] * len(clips)
    for (frames, height, width), members in by_size.items():
        first = np.stack([clips[i][0][0] for i in members]) if from_first_frame else None
        generated = pipeline.generate([clips[i][1]["caption"] for i in members], frames, height, width, args.steps,
                                      args.guidance, args.seed, first)
        for i, clip in zip(members, generated):
            out[i] = clip
    return out


def evaluate(args: argparse.Namespace) -> tuple[dict, Path]:
    analyser = ShapesAnalyser().fit(read_clips(args.clips / "train", FIT_CLIPS))
    held_out = [(frames, meta) for frames, meta in read_clips(args.clips / "eval") if len(frames) > 1][: args.limit]
    if not held_out:
        raise FileNotFoundError(f"no moving eval clips under {args.clips / 'eval'}")
    generated = {}
    for name, run, first in (("I2V", args.i2v_run, True), ("T2V", args.t2v_run, False)):
        run_cfg, model_cfg, state, _ = load_run_weights(run, None, not args.no_ema)
        if first and model_cfg.first_frame_probability <= 0:
            raise ValueError(f"{run}: trained without first-frame conditioning (model.first_frame_probability 0)")
        pipeline = pipeline_from_weights(run_cfg.model.arch, model_cfg, state, run_cfg.data.train_path, args.device)
        generated[name] = generate(pipeline, held_out, args, first)
    latents = {_identity(s.meta): s.latent for s in read_latents(Path(run_cfg.data.eval_path), model_cfg)}
    generated["copied frame"] = [np.repeat(frames[:1], len(frames), axis=0) for frames, _ in held_out]
    generated["ground truth through the VAE"] = [pipeline.decode(latents[_identity(meta)][None])[0]
                                                 if _identity(meta) in latents else None for _, meta in held_out]
    scores = {}
    for name in SETTINGS:
        judged = [judge(clip, frames, meta, analyser) for clip, (frames, meta) in zip(generated[name], held_out)
                  if clip is not None]
        scores[name] = {key: float(np.mean([j[key] for j in judged])) for key in judged[0]} if judged else {}
    out_dir = args.out or args.i2v_run / "image_to_video"
    rows = [clip for i in range(min(8, len(held_out)))
            for clip in (held_out[i][0], generated["I2V"][i], generated["T2V"][i])]
    labels = [label for _, meta in held_out[:8]
              for label in (f"truth: {meta['caption']}", "I2V from its first frame", "T2V from the caption")]
    sheet = write_contact_sheet(rows, labels, out_dir / "contact_sheet.png")
    result = {"clips": len(held_out), "sampler": {"steps": args.steps, "guidance": args.guidance, "seed": args.seed},
              "runs": {"I2V": str(args.i2v_run), "T2V": str(args.t2v_run)}, "scores": scores,
              "contact_sheet": str(sheet)}
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "scores.json").write_text(json.dumps(result, indent=2) + "\n")
    return result, out_dir


def format_scores(scores: dict[str, dict[str, float]]) -> str:
    lines = [f"{'':<30}{'frame 0 PSNR':>14}{'frames 1.. PSNR':>17}{'centroid err px':>17}{'direction':>11}"]
    for name, s in scores.items():
        if s:
            lines.append(f"{name:<30}{s['first_frame_psnr']:>11.1f} dB{s['later_frames_psnr']:>14.1f} dB"
                         f"{s['centroid_error_px']:>17.2f}{s['direction_right']:>11.1%}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="eval_image_to_video", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("i2v_run", type=Path, help="the I2V run's train.output_dir")
    parser.add_argument("t2v_run", type=Path, help="the T2V run's train.output_dir (same data)")
    parser.add_argument("--limit", type=int, default=64, help="moving held-out clips (default %(default)s)")
    parser.add_argument("--clips", type=Path, default=DEFAULT_CLIPS, help="the raw clip set (train fits the analyser)")
    parser.add_argument("--out", type=Path, default=None, help="output folder")
    return run_eval(parser, argv, evaluate, lambda result: (
        f"{result['clips']} held-out moving clips: first frame + caption\n" + format_scores(result["scores"])))


if __name__ == "__main__":
    sys.exit(main())
