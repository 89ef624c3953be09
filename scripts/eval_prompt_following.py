"""Prompt following of a trained video DiT on the held-out moving-shapes captions.

    bash scripts/eval_prompt_following.sh RUN_DIR [--limit 48] [--samples-per-caption 1]
        [--clips data/cache/video/moving_shapes] [--steps 30] [--guidance 4] [--seed 0]
        [--checkpoint STEP_DIR] [--no-ema] [--out DIR]

Samples the first ``--limit`` distinct captions of the eval clips (held-out attribute
combinations), each at its ground-truth clip's frames x height x width and from
``--samples-per-caption`` seeds (``--seed`` on), with the run's newest checkpoint (EMA weights when
it has them), and judges every generated clip with the analyser of
``data/moving_shapes_analysis.py``, fitted on the train clips' ground-truth frames only. Prints
per-attribute accuracy of: the model against its own captions; the same clips against captions
shuffled among them (what ignoring the prompt scores); the ground-truth eval clips themselves
(the analyser's ceiling); and the eval clips' latents decoded by the VAE (the ceiling of any DiT
trained on these latents: what the VAE loses, no DiT can generate). Writes ``scores.json`` and a
contact sheet of the generated clips to ``--out`` (default ``RUN_DIR/prompt_following/<checkpoint name>``).
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
from moving_shapes_analysis import ShapesAnalyser, accuracy, format_table, shuffled  # noqa: E402

from models.dit.media import write_contact_sheet  # noqa: E402
from models.dit.sample import SampleSettings, add_sample_arguments, pipeline_from_weights  # noqa: E402
from veomni.checkpoint.export import load_run_weights  # noqa: E402
from veomni.data.sources import ReadStats, iter_tar_samples, resolve_files  # noqa: E402
from veomni.data.video.clip_format import CorruptClipError, decode_clip  # noqa: E402
from veomni.data.video.latents import decode_sample  # noqa: E402

DEFAULT_CLIPS = REPO / "data" / "cache" / "video" / "moving_shapes"
FIT_CLIPS = 2000


def read_clips(split: Path, limit: int | None = None) -> list[tuple[np.ndarray, dict]]:
    """(frames, json) of a raw clip split's samples, in shard order; corrupt samples are skipped."""
    _, files = resolve_files(str(split), "webdataset")
    clips = []
    for sample in iter_tar_samples(files, max_bad_fraction=1.0, stats=ReadStats(), warn=False):
        try:
            clip = decode_clip(sample)
        except CorruptClipError:
            continue
        clips.append((clip.frames, clip.meta))
        if len(clips) == limit:
            break
    return clips


def read_latents(split: Path, model_cfg) -> list:
    """The samples of a latent split (``video_latents`` format), in shard order."""
    _, files = resolve_files(str(split), "webdataset")
    records = iter_tar_samples(files, max_bad_fraction=1.0, stats=ReadStats(), warn=False)
    return [decode_sample(record, model_cfg.in_channels, model_cfg.text_dim) for record in records]


def generate_for(pipeline, metas: list[dict], settings) -> list[np.ndarray]:
    """One generated clip per caption, at its ground-truth clip's size (same-size captions batched)."""
    by_size: dict[tuple[int, int, int], list[int]] = defaultdict(list)
    for i, meta in enumerate(metas):
        by_size[(meta["frames"], meta["height"], meta["width"])].append(i)
    clips: list[np.ndarray | None] = [None] * len(metas)
    for (frames, height, width), members in by_size.items():
        generated = pipeline.generate([metas[i]["caption"] for i in members], frames, height, width,
                                      settings.steps, settings.guidance, settings.seed)
        for i, clip in zip(members, generated):
            clips[i] = clip
    return clips


def evaluate(args: argparse.Namespace) -> tuple[dict, Path]:
    run_cfg, model_cfg, state, checkpoint = load_run_weights(args.run_dir, args.checkpoint, not args.no_ema)
    analyser = ShapesAnalyser().fit(read_clips(args.clips / "train", FIT_CLIPS))
    eval_clips = read_clips(args.clips / "eval")
    if not eval_clips:
        raise FileNotFoundError(f"no eval clips under {args.clips / 'eval'}")
    prompts: dict[str, dict] = {}
    for _, meta in eval_clips:
        prompts.setdefault(meta["caption"], meta)
    metas = list(prompts.values())[: args.limit]
    pipeline = pipeline_from_weights(run_cfg.model.arch, model_cfg, state, run_cfg.data.train_path, args.device)
    generated, judged = [], []
    for k in range(args.samples_per_caption):
        settings = SampleSettings(steps=args.steps, guidance=args.guidance, seed=args.seed + k)
        generated += generate_for(pipeline, metas, settings)
        judged += metas
    found = [analyser.analyse(clip) for clip in generated]
    through_vae = [(pipeline.decode(sample.latent[None])[0], sample.meta)
                   for sample in read_latents(Path(run_cfg.data.eval_path or run_cfg.data.train_path), model_cfg)]
    scores = {
        "model": accuracy(found, judged),
        "shuffled captions": accuracy(found, shuffled(judged, args.seed)),
        "ground truth": accuracy([analyser.analyse(clip) for clip, _ in eval_clips], [m for _, m in eval_clips]),
        "ground truth through the VAE": accuracy([analyser.analyse(clip) for clip, _ in through_vae],
                                                 [m for _, m in through_vae]),
    }
    out_dir = args.out or args.run_dir / "prompt_following" / checkpoint.name
    sheet = write_contact_sheet(generated[:len(metas)], [m["caption"] for m in metas], out_dir / "contact_sheet.png")
    result = {"checkpoint": str(checkpoint), "captions": len(metas), "samples": len(generated),
              "ground_truth_clips": len(eval_clips),
              "sampler": {"steps": args.steps, "guidance": args.guidance, "seed": args.seed}, "scores": scores,
              "contact_sheet": str(sheet),
              "clips": [{"caption": m["caption"], "found": f} for m, f in zip(judged, found)]}
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "scores.json").write_text(json.dumps(result, indent=2) + "\n")
    return result, out_dir


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="eval_prompt_following", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("run_dir", type=Path, help="the run's train.output_dir")
    parser.add_argument("--limit", type=int, default=48, help="held-out captions to sample (default %(default)s)")
    parser.add_argument("--samples-per-caption", type=int, default=1,
                        help="clips generated per caption, from seeds --seed, --seed + 1, ...")
    parser.add_argument("--clips", type=Path, default=DEFAULT_CLIPS,
                        help="the raw clip set: its train split fits the analyser, its eval split gives the captions")
    parser.add_argument("--out", type=Path, default=None, help="output folder")
    return run_eval(parser, argv, evaluate, lambda result: (
        f"{result['captions']} held-out captions, {result['samples']} generated clips, {result['checkpoint']}\n"
        + format_table(result["scores"])))


def run_eval(parser: argparse.ArgumentParser, argv: list[str] | None, evaluate, report) -> int:
    """The judges' shared command line: sampling options, then evaluate, print ``report(result)`` and the
    scores file; a missing or bad input exits 2 with one line."""
    add_sample_arguments(parser, sizes=False)  # each clip is sampled at its own size
    args = parser.parse_args(argv)
    try:
        result, out_dir = evaluate(args)
    except (FileNotFoundError, ValueError) as exc:
        print(f"eval error: {exc}", file=sys.stderr)
        return 2
    print(report(result))
    print(out_dir / "scores.json")
    return 0


if __name__ == "__main__":
    sys.exit(main())
