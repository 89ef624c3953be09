"""The pipeline bubble of an omni model with its encoders colocated on every pipeline rank and
their items spread over the pipeline's ranks (``parallel.encoder_colocate: true``,
veomni/parallel/pipeline_media.py) against run inline in the first stage (``false``): per rank,
busy time (stage forward/backward chunks and the encoders' pre- and post-pass, the router's
exchanges included) and idle time (the rest of the step: waiting on the other stage) per step.

    python scripts/bench_pipeline_media.py [--steps 4] [--microbatches 4] [--images 4] [--encoder-fsdp 0]

2 CPU processes with one thread each (pp=2, 1F1B): on this 2-core machine more processes would
share cores, and a rank waiting in a collective would hand its core to the others and hide the
bubble. Prints one line per mode and rank, the ratio of idle fractions (inline / colocated) and
of tokens/s (colocated / inline).
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import models  # noqa: E402,F401  (registers the zoo)
from tests.dist_harness import run_distributed  # noqa: E402
from tests.omni_utils import TINY_OMNI, TOKENIZER, chat_record, png_bytes  # noqa: E402
from veomni.config.schema import ParallelConfig, TrainConfig  # noqa: E402
from veomni.data.loader import load_tokenizer  # noqa: E402
from veomni.data.multimodal import SampleProcessor, pack_chat_samples  # noqa: E402
from veomni.parallel.apply import parallelize  # noqa: E402
from veomni.parallel.mesh import ParallelDims, build_mesh  # noqa: E402
from veomni.parallel.pipeline import build_pipeline  # noqa: E402
from veomni.spec import build_model, get_model_spec  # noqa: E402
from veomni.train.optim import build_optimizer  # noqa: E402
from veomni.train.pipeline_step import pipeline_forward_backward  # noqa: E402
from veomni.train.step import clip_and_step  # noqa: E402

OPTIONS = {**TINY_OMNI, "llm": {**TINY_OMNI["llm"], "num_layers": 4, "tie_embeddings": False}}


class Busy:
    """Wall time spent inside wrapped calls (compute, not waiting on another rank)."""

    def __init__(self) -> None:
        self.seconds = 0.0

    def wrap(self, obj: object, name: str) -> None:
        inner = getattr(obj, name)

        def timed(*args, **kwargs):
            start = time.perf_counter()
            try:
                return inner(*args, **kwargs)
            finally:
                self.seconds += time.perf_counter() - start

        setattr(obj, name, timed)


def _rank(rank: int, world: int, colocate: bool, steps: int, microbatches: int, images: int,
          encoder_fsdp: int) -> list[tuple[float, float, int]]:
    """Per measured step: (wall seconds, busy seconds, tokens of the step) on this rank."""
    torch.set_num_threads(1)
    parallel = ParallelConfig(pp=2, pp_schedule="1F1B", encoder_colocate=colocate,
                              encoder_fsdp=encoder_fsdp if colocate else 0)
    meshes = build_mesh(ParallelDims.resolve(parallel, world), "cpu")

    def build():
        torch.manual_seed(0)
        return build_model("omni", OPTIONS)[1]

    with torch.device("meta"):
        meta = build()
    task = get_model_spec("omni").task(meta.config)
    pipe = build_pipeline(build, lambda m: m.init_weights(), lambda m: parallelize(m, parallel, meshes, "cpu"),
                          parallel, microbatches, meshes.pp, torch.device("cpu"), task, meshes)
    optimizer = build_optimizer(pipe.modules, TrainConfig(optimizer="sgd", lr=0.01, weight_decay=0.0))
    busy = Busy()
    for stage in pipe.stages:
        busy.wrap(stage, "forward_one_chunk")
        busy.wrap(stage, "backward_one_chunk")
    if pipe.encoders is not None:
        busy.wrap(pipe.encoders, "encode")
        busy.wrap(pipe.encoders, "backward")
    process = SampleProcessor(load_tokenizer(str(TOKENIZER)), meta.config)
    batches = [pack_chat_samples([process(chat_record(f"s{i}{j}", "What color is it?", "red", png_bytes(i, 84, 84)))
                                  for j in range(images)]) for i in range(microbatches)]
    row = max(task.contract.row_length(b) for b in batches)
    fractions = []
    for step in range(steps + 1):  # the first step warms up (shape inference): not counted
        busy.seconds = 0.0
        start = time.perf_counter()
        pipeline_forward_backward(pipe, task, batches, meshes.loss.get_group(), 1, 2, row, meta)
        clip_and_step(pipe.modules, optimizer, None, 0.0, meshes.pp.get_group())
        wall = time.perf_counter() - start
        if step:
            fractions.append((wall, busy.seconds, sum(task.contract.row_length(b) for b in batches)))
    return fractions


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--microbatches", type=int, default=4)
    parser.add_argument("--images", type=int, default=4, help="84x84 images per micro-batch")
    parser.add_argument("--encoder-fsdp", type=int, default=0,
                        help="colocated: parallel.encoder_fsdp (1: encoders replicated, no parameter all-gathers; "
                             "0: sharded over both ranks)")
    args = parser.parse_args()
    idle, tokens_per_s = {}, {}
    for colocate in (False, True):
        mode = "colocated" if colocate else "inline"
        ranks = run_distributed(_rank, 2, colocate, args.steps, args.microbatches, args.images,
                                args.encoder_fsdp, timeout_s=900,
                                env={"OMP_NUM_THREADS": "1"})
        idle[mode] = []
        tokens_per_s[mode] = ranks[0][0][2] / max(sum(s[0] for s in steps) / len(steps) for steps in ranks)
        for rank, steps in enumerate(ranks):
            wall = sum(s[0] for s in steps) / len(steps)
            busy = sum(s[1] for s in steps) / len(steps)
            idle[mode].append((wall - busy) / wall)
            print(f"{mode:<9} rank {rank}: step {wall * 1e3:8.1f} ms, busy {busy * 1e3:8.1f} ms, "
                  f"idle {100 * (wall - busy) / wall:5.1f}%")
    mean = {mode: sum(v) / len(v) for mode, v in idle.items()}
    print(f"mean idle fraction: inline {100 * mean['inline']:.1f}%, colocated {100 * mean['colocated']:.1f}%; "
          f"ratio inline/colocated {mean['inline'] / max(mean['colocated'], 1e-9):.2f}")
    print(f"tokens/s: inline {tokens_per_s['inline']:.0f}, colocated {tokens_per_s['colocated']:.0f}; "
          f"ratio colocated/inline {tokens_per_s['colocated'] / tokens_per_s['inline']:.2f}")


if __name__ == "__main__":
    main()
