"""Tokens/s of the tiny VLM (or the tiny audio model) as the media:text mix sweeps from 1:9 to 9:1,
with encoder-work techniques off and on, and how unevenly the ranks' encoder work is spread.

    python scripts/bench_colocate.py [--model vlm|audio] [--techniques balance,long_short,...]
                                     [--shares 0.1 0.3 ...] [--steps 20] [--warmup 2] [--tokens 1024]
                                     [--encoder-width 192] [--encoder-layers 4] [--long-threshold 64]
                                     [--seed 0] [--quick]
                                     [--out FILE.json] [--plot docs/img/colocate_sweep.png]

Two gloo ranks of one thread each (``harness/gloo_ranks.py``): on a 2-core machine more processes
would share cores, and a rank waiting in a collective would hand its core to another and hide
the imbalance. The model is the recipe's (``recipes/seed1.5-vl/tiny.yaml``; ``--model audio``:
``recipes/audio/tiny_audio_caption.yaml``) with seeded random weights, trained through the
engine: ``parallelize()`` with the recipe's parallel section plus the technique's overrides,
``forward_backward`` + ``clip_and_step`` (AdamW), one micro-batch per rank and step.

Data: every rank draws its own samples from its own seeded stream: with probability ``share`` a
media sample (one image, sides long-tailed between the encoder's min and max pixels: mostly
small, a few large; audio: clips of 0.2 s to the encoder's longest, the same way), else a
text-only sample; it fills its micro-batch up to ``--tokens`` LLM tokens. The LLM's work is then
even across ranks and the encoders' is not: the dynamic mix. The seeds are the same for every
configuration, so off and on train on identical micro-batches.

Per share, for each technique (the off run is shared by the techniques of a share):
- tokens/s: the LLM rows' tokens (text and media placeholders: the trainer's tokens/s) of both
  ranks over the slower rank's step time, median over the steps after warm-up; off, on, on/off;
- imbalance: the busiest rank's encoder FLOPs over the mean rank's, each summed over the measured
  steps (the encoder time the step waits for over a perfect split's), measured: every real
  encoder call is priced by the family's cost model (``MediaKind.flops`` on its inputs; a
  sequence-parallel share by its fraction of the rows; dummy calls 0);
- encoder share: the encoders' part of the step's FLOPs (the family's cost model), the most any
  balancing of encoder work can win.

Techniques are rows of ``TECHNIQUES``: ParallelConfig overrides (``balance``, ``long_short``,
both, and ``pp``: one 2-stage pipeline over both ranks whose micro-batches are the two ranks'
draws, the encoders colocated on both ranks and placed around each stage's work, against the
same pipeline with the encoders inline in its first stage; its rows also give each run's
bubble, the ranks' time outside their stage chunks and encoder passes), checked by the
launcher's own model checks before any rank starts. The encoder is resized
(``--encoder-width``, ``--encoder-layers``; default a 192-wide, 4-layer ViT) because the tiny
recipe's is about 1% of the step's FLOPs, far below a real VLM's (a 675M ViT beside a 7B LLM
costs about a third of an image token's FLOPs); the LLM stays the recipe's.

Take figures with nothing else running: a busy machine hides or invents imbalance.
"""

from __future__ import annotations

import argparse
import json
import math
import random
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "scripts"))

from _colocate_report import plot, print_table, summarize  # noqa: E402

import models  # noqa: E402,F401  (registers the zoo)
from harness.gloo_ranks import run_distributed  # noqa: E402
from harness.media_bytes import png_bytes, wav_bytes  # noqa: E402
from veomni.config.load import load_config  # noqa: E402
from veomni.config.schema import RunConfig  # noqa: E402
from veomni.contract import build_model, get_model_spec  # noqa: E402
from veomni.data.chat.media_dataset import SampleProcessor, pack_chat_samples  # noqa: E402
from veomni.data.text.packed import load_tokenizer  # noqa: E402
from veomni.launch import _validate_model  # noqa: E402  (the launcher's model checks)
from veomni.optim import build_optimizer  # noqa: E402
from veomni.parallel.apply import PIPELINE_HOOKS, parallelize  # noqa: E402
from veomni.parallel.media.encoder_work import watch_encoder_work  # noqa: E402
from veomni.parallel.mesh import ParallelDims, build_mesh  # noqa: E402
from veomni.parallel.pipeline.stages import build_pipeline  # noqa: E402
from veomni.train.runners.pipeline_step import pipeline_forward_backward  # noqa: E402
from veomni.train.step import clip_and_step, forward_backward  # noqa: E402

RANKS = 2
SHARES = (0.1, 0.3, 0.5, 0.7, 0.9)
QUICK_SHARES = (0.5, 0.9)
WORDS = ("the", "a", "red", "blue", "small", "large", "square", "circle", "left", "right", "above", "below",
         "how", "many", "what", "is", "there", "one", "two", "three", "colour", "shape", "near", "far", "and",
         "of", "in", "on", "sound", "tone", "loud", "quiet", "short", "long", "high", "low", "bright", "dark")


@dataclass(frozen=True)
class Technique:
    """One row of the sweep: what turns it on (``ParallelConfig`` overrides over the recipe's
    parallel section; ``{threshold}`` in a value stands for ``--long-threshold``) and, when it is
    not the plain recipe, the run it is compared with."""

    parallel: dict[str, Any]
    baseline: dict[str, Any] | None = None
    """Overrides of the technique's own "off" run; None: the shared plain recipe."""


TECHNIQUES = {
    "balance": Technique({"encoder_balance": True}),
    "long_short": Technique({"encoder_sp": RANKS, "encoder_sp_threshold": "{threshold}"}),
    "balance+long_short": Technique({"encoder_balance": True, "encoder_sp": RANKS,
                                     "encoder_sp_threshold": "{threshold}"}),
    # The tiny LLM's 4 blocks split 3 / 1: its last stage carries the 8200-word head (5x a block's
    # FLOPs) and the embedding is a lookup, so 3 / 1 is the split closest to even work.
    "pp": Technique({"pp": RANKS, "pp_layer_split": [3, 1]},
                    baseline={"pp": RANKS, "pp_layer_split": [3, 1], "encoder_colocate": False}),
}


def off_run(name: str) -> str:
    """The name of the run ``name`` is compared with."""
    return f"{name}:off" if TECHNIQUES[name].baseline is not None else "off"


def long_tailed(rng: random.Random, low: float, high: float) -> float:
    """Mostly near ``low``, a few near ``high`` (median at an eighth of the range, 10% above 73%)."""
    return low + (high - low) * rng.random() ** 3


def image_bytes(rng: random.Random, cfg: Any) -> bytes:
    low, high = math.isqrt(cfg.min_pixels), math.isqrt(cfg.max_pixels)
    return png_bytes(rng.randrange(2**31), round(long_tailed(rng, low, high)), round(long_tailed(rng, low, high)))


def audio_bytes(rng: random.Random, cfg: Any) -> bytes:
    longest = (cfg.max_frames - 1) * cfg.hop_length / cfg.sample_rate
    return wav_bytes(rng.randrange(2**31), long_tailed(rng, 0.2, longest))


@dataclass(frozen=True)
class Workload:
    recipe: Path
    modality: str
    question: str
    media_bytes: Callable[[random.Random, Any], bytes]
    """(the sample stream, the encoder's config) -> one item's shard bytes."""
    resize: Callable[[int, int], dict[str, int]]
    """(width, layers) -> the encoder config keys that set them."""


def transformer_size(width: int, layers: int) -> dict[str, int]:
    return {"hidden_size": width, "num_layers": layers, "intermediate_size": 4 * width}


WORKLOADS = {
    "vlm": Workload(REPO / "recipes" / "seed1.5-vl" / "tiny.yaml", "image", "What is in the picture?", image_bytes,
                    transformer_size),
    "audio": Workload(REPO / "recipes" / "audio" / "tiny_audio_caption.yaml", "audio", "Describe the sound.",
                      audio_bytes, transformer_size),
}


def configurations(cfg: RunConfig, techniques: list[str], args: argparse.Namespace) -> dict[str, RunConfig]:
    """"off" and each technique's recipe, the encoder resized by ``--encoder-width/--encoder-layers``;
    exits with the launcher's reasons where one cannot run."""
    workload = WORKLOADS[args.model]
    encoders = dict(cfg.model.options["encoders"])
    encoders[workload.modality] = {**encoders[workload.modality], **workload.resize(args.encoder_width,
                                                                                 args.encoder_layers)}
    cfg = replace(cfg, model=replace(cfg.model, options={**cfg.model.options, "encoders": encoders}))

    def overrides(technique: Technique) -> dict[str, Any]:
        return {k: int(v.format(threshold=args.long_threshold)) if isinstance(v, str) else v
                for k, v in technique.parallel.items()}

    def with_parallel(values: dict[str, Any]) -> RunConfig:
        return replace(cfg, parallel=replace(cfg.parallel, **overrides(Technique(values))))

    runs = {"off": cfg}
    for name in techniques:
        if TECHNIQUES[name].baseline is not None:
            runs[off_run(name)] = with_parallel(TECHNIQUES[name].baseline)
        runs[name] = with_parallel(TECHNIQUES[name].parallel)
    problems = []
    for name, run in runs.items():
        try:
            ParallelDims.resolve(run.parallel, RANKS)
            problems += [f"{name}: {p}" for p in _validate_model(run)[2]]
        except ValueError as exc:
            problems.append(f"{name}: {exc}")
    if problems:
        sys.exit("technique cannot run on this model and layout:\n" + "\n".join(problems))
    return runs


def words(rng: random.Random, low: int, high: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(rng.randint(low, high)))


def draw_record(rng: random.Random, key: str, share: float, workload: Workload, kind: Any, encoder_cfg: Any) -> dict:
    """A media sample with probability ``share`` (a short question about one item), else a text-only
    one (a longer question and answer)."""
    if rng.random() < share:
        messages = [{"role": "user", "content": f"{kind.placeholder}\n{workload.question}"},
                    {"role": "assistant", "content": words(rng, 1, 8)}]
        return {"__key__": key, "json": json.dumps({"messages": messages}).encode(),
                kind.fields[0]: workload.media_bytes(rng, encoder_cfg)}
    messages = [{"role": "user", "content": words(rng, 8, 64)}, {"role": "assistant", "content": words(rng, 2, 24)}]
    return {"__key__": key, "json": json.dumps({"messages": messages}).encode()}


def rank_batches(rank: int, share: float, steps: int, args: argparse.Namespace, workload: Workload,
                 process: SampleProcessor) -> list[dict]:
    """This rank's micro-batch of each step: its own stream's samples up to ``args.tokens`` LLM tokens."""
    kind, encoder_cfg = process.modalities[workload.modality], process.encoder_configs[workload.modality]
    rng = random.Random(f"{args.seed}/{rank}")
    batches, pending, drawn = [], None, 0
    for _ in range(steps):
        samples, length = [], 0
        while True:
            if pending is None:
                pending = process(draw_record(rng, f"r{rank}-{drawn}", share, workload, kind, encoder_cfg))
                drawn += 1
            if samples and length + len(pending.chat.ids) > args.tokens:
                break
            samples.append(pending)
            length += len(pending.chat.ids)
            pending = None
        batches.append(pack_chat_samples(samples))
    return batches


def train(run: RunConfig, batches: list[dict], modality: str) -> dict[str, list]:
    """Per step on this rank: wall time (after a barrier), the step's global LLM tokens, and the
    encoder FLOPs this rank ran (``watch_encoder_work``)."""
    meshes = build_mesh(ParallelDims.resolve(run.parallel, dist.get_world_size()), "cpu")
    torch.manual_seed(0)
    config, model = build_model(run.model.arch, run.model.options)
    model.init_weights()
    task = get_model_spec(run.model.arch).task(config)
    model = parallelize(model, run.parallel, meshes, "cpu")
    optimizer = torch.optim.AdamW(model.parameters(), lr=run.train.lr, weight_decay=run.train.weight_decay)
    ran = watch_encoder_work([model], modality)
    record: dict[str, list] = {"times": [], "tokens": [], "loads": []}
    for batch in batches:
        dist.barrier()
        ran.reset()
        start = time.perf_counter()
        metrics = forward_backward(model, task, [batch], meshes.loss.get_group(), meshes.dims.loss_size)
        clip_and_step(model, optimizer, None, run.train.max_grad_norm)
        record["times"].append(time.perf_counter() - start)
        record["tokens"].append(metrics["units"])
        record["loads"].append(ran.flops)
    return record


def train_pipeline(run: RunConfig, steps: list[list[dict]], modality: str, row_length: int) -> dict[str, list]:
    """``train`` for a pipeline over all ranks (one data-parallel group): each step's micro-batches
    are every rank's draw of that step; also the rank's busy seconds per step (inside its stage
    chunks and its encoder passes; the rest of the step it waits: the bubble)."""
    meshes = build_mesh(ParallelDims.resolve(run.parallel, dist.get_world_size()), "cpu")

    def build() -> torch.nn.Module:
        torch.manual_seed(0)
        return build_model(run.model.arch, run.model.options)[1]

    with torch.device("meta"):
        meta = build()
    task = get_model_spec(run.model.arch).task(meta.config)
    pipe = build_pipeline(build, lambda m: m.init_weights(), lambda m: parallelize(m, run.parallel, meshes, "cpu"),
                          run.parallel, len(steps[0]), meshes.pp, torch.device("cpu"), task, meshes,
                          hooks=PIPELINE_HOOKS)
    optimizer = build_optimizer(pipe.modules, run.train)
    ran, busy = watch_encoder_work(pipe.modules, modality), [0.0]

    def timed(obj: object, name: str) -> None:
        inner = getattr(obj, name)

        def wrapper(*args: Any, **kwargs: Any) -> Any:
            start = time.perf_counter()
            try:
                return inner(*args, **kwargs)
            finally:
                busy[0] += time.perf_counter() - start

        setattr(obj, name, wrapper)

    for stage in pipe.stages:
        timed(stage, "forward_one_chunk")
        timed(stage, "backward_one_chunk")
    if pipe.encoders is not None:
        timed(pipe.encoders, "encode")
        timed(pipe.encoders, "backward")
    record: dict[str, list] = {"times": [], "tokens": [], "loads": [], "busy": []}
    for micro_batches in steps:
        dist.barrier()
        ran.reset()
        busy[0] = 0.0
        start = time.perf_counter()
        metrics = pipeline_forward_backward(pipe, task, micro_batches, meshes.loss.get_group(),
                                            meshes.dims.loss_size, meshes.dims.pp, row_length, meta)
        clip_and_step(pipe.modules, optimizer, None, run.train.max_grad_norm, meshes.pp.get_group())
        record["times"].append(time.perf_counter() - start)
        record["tokens"].append(metrics["units"])
        record["loads"].append(ran.flops)
        record["busy"].append(busy[0])
    return record


def _worker(rank: int, world: int, args: argparse.Namespace, runs: dict[str, RunConfig]) -> list[dict]:
    """Every share: the step FLOPs of this rank's micro-batches (all, and the encoder's), and each
    run's timings and encoder work."""
    workload, recipe = WORKLOADS[args.model], runs["off"]
    with torch.device("meta"):
        config, meta = build_model(recipe.model.arch, recipe.model.options)
    process = SampleProcessor(load_tokenizer(recipe.data.tokenizer), config)
    kind, encoder = process.modalities[workload.modality], meta.encoders[workload.modality]
    cost = get_model_spec(recipe.model.arch).cost
    points = []
    for share in args.shares:
        batches = rank_batches(rank, share, args.warmup + args.steps, args, workload, process)
        measured = batches[args.warmup:]
        inputs = [b["media"].get(workload.modality, {}).get("inputs") for b in measured]
        point = {"share": share, "flops": sum(cost.batch_flops(meta, b) for b in measured),
                 "encoder_flops": sum(kind.flops(encoder, i) for i in inputs if i is not None), "runs": {}}
        every_rank = None
        for name, run in runs.items():
            if run.parallel.pp > 1:  # one pipeline over the ranks: a step's micro-batches are every rank's draw
                every_rank = every_rank or [rank_batches(r, share, args.warmup + args.steps, args, workload, process)
                                            for r in range(world)]
                record = train_pipeline(run, [list(step) for step in zip(*every_rank)], workload.modality,
                                        args.tokens)
            else:
                record = train(run, batches, workload.modality)
            point["runs"][name] = {key: values[args.warmup:] for key, values in record.items()}
            if rank == 0:
                print(f"  {workload.modality} share {share:.0%}: {name} done", file=sys.stderr, flush=True)
        points.append(point)
    return points


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", choices=sorted(WORKLOADS), default="vlm")
    parser.add_argument("--techniques", default="balance",
                        help=f"comma-separated, each run off and on; known: {', '.join(TECHNIQUES)}")
    parser.add_argument("--shares", type=float, nargs="+", default=list(SHARES), help="media sample probabilities")
    parser.add_argument("--steps", type=int, default=20, help="measured steps per run")
    parser.add_argument("--warmup", type=int, default=2, help="steps before measuring")
    parser.add_argument("--tokens", type=int, default=1024, help="LLM tokens per rank micro-batch")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--encoder-width", type=int, default=192,
                        help="the encoder's width (its MLP 4x); the recipe's tiny encoder is ~1%% of the FLOPs")
    parser.add_argument("--encoder-layers", type=int, default=4)
    parser.add_argument("--long-threshold", type=int, default=64,
                        help="encoder sequence rows above which an item is long (long_short)")
    parser.add_argument("--quick", action="store_true",
                        help=f"shares {QUICK_SHARES}, 1 warm-up + 3 measured steps of 384 tokens")
    parser.add_argument("--out", type=Path, help="write the rows as JSON here")
    parser.add_argument("--plot", type=Path, help="write the sweep chart (PNG) here")
    args = parser.parse_args()
    args.techniques = [t for t in args.techniques.split(",") if t]
    unknown = [t for t in args.techniques if t not in TECHNIQUES]
    if unknown or not args.techniques:
        parser.error(f"--techniques: unknown {unknown or 'none given'}; known: {', '.join(TECHNIQUES)}")
    if args.quick:
        args.shares, args.warmup, args.steps, args.tokens = list(QUICK_SHARES), 1, 3, 384
    return args


def main() -> None:
    args = parse_args()
    torch.set_num_threads(1)  # before any torch work: the ranks are forked from this process
    workload = WORKLOADS[args.model]
    runs = configurations(load_config(workload.recipe), args.techniques, args)
    title = f"{workload.recipe.relative_to(REPO)}, {RANKS} ranks x 1 thread, {args.tokens} LLM tokens per rank step"
    print(f"{title}; {args.warmup} warm-up + {args.steps} measured steps; techniques: {', '.join(args.techniques)}\n",
          flush=True)
    started = time.perf_counter()
    ranks = run_distributed(_worker, RANKS, args, runs, timeout_s=3600)
    rows = summarize(ranks, {name: off_run(name) for name in args.techniques})
    print_table(rows, workload.modality)
    print(f"\n{time.perf_counter() - started:.0f} s in all")
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps({"setup": {k: str(v) if isinstance(v, Path) else v
                                                  for k, v in vars(args).items()}, "rows": rows}, indent=1))
    if args.plot:
        plot(args.plot, rows, args.techniques, title, workload.modality)


if __name__ == "__main__":
    main()
