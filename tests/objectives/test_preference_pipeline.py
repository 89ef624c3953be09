"""DPO under pipeline parallelism (pp 2) equals one process: losses, pair metrics, gradients and
parameters after two SGD steps, and the held-out pairs' eval (fp32, the parity rule).

A pipeline's last stage sees only its own output, yet a pair loss needs each reply's summed
log-probability, the policy's and the reference's. The preference task is a ``RowLossTask``
(``veomni/tasks/staged.py``): before each step's schedule the pipeline hands it the step's rows,
whose samples it numbers anew (GPipe with 2 pipeline micro-batches joins two loader micro-batches
per row) and which it walks once through the reference's stages (a frozen copy cut like the policy,
or under LoRA the policy's stages with adapters off), keeping the per-sample sums on the last stage;
the loss is then computed there from the logits and the whole row.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from harness.gloo_ranks import run_distributed
from tests.objectives.pairs import packed_pairs, pair_tokens
from tests.objectives.test_preference_layouts import BETA, STEPS, _check, _run
from tests.parallel.test_lora_parity import adapt
from tests.parity_utils import TINY_LLM, assert_parity, full_grads, full_params
from veomni.config.schema import ParallelConfig, RunConfig
from veomni.contract import build_model
from veomni.objectives import FrozenModels, ObjectiveRequest, build_objective
from veomni.objectives.preference import PAIR_METRICS
from veomni.parallel.apply import PIPELINE_HOOKS, parallelize
from veomni.parallel.mesh import ParallelDims, build_mesh
from veomni.parallel.pipeline.stages import build_pipeline, build_stage_parts
from veomni.tasks.lm import LanguageModelingTask
from veomni.train.runners.pipeline_step import pipeline_forward_backward, pipeline_rows
from veomni.train.step import clip_and_step

OPTIONS = {"num_layers": 4, "tie_embeddings": False}
"""Four blocks: two stages per rank for the interleaved and V schedules."""
ROW_TOKENS = 64
"""A loader micro-batch of two pairs holds at most 60 tokens."""
EVAL = [pair_tokens(2, seed=90 + i) for i in range(4)]


def _model(seed: int, lora: bool) -> nn.Module:
    torch.manual_seed(seed)  # as tests.parity_utils.tiny_model; init_weights runs after the cut's build
    model = build_model("llm", {**TINY_LLM, **OPTIONS})[1]
    return adapt(model) if lora else model


def _pipelined(rank: int, world: int, parallel: ParallelConfig, microbatches: int, lora: bool) -> dict:
    dims = ParallelDims.resolve(parallel, world)
    meshes = build_mesh(dims, "cpu")
    cfg = RunConfig()
    cfg.train.objective, cfg.preference.beta = "dpo", BETA
    objective = build_objective(ObjectiveRequest(cfg, LanguageModelingTask()))
    task = objective.task
    recipe = lambda m: parallelize(m, parallel, meshes, "cpu")  # noqa: E731
    init = lambda m: m.init_weights()  # noqa: E731
    pipe = build_pipeline(lambda: _model(0, lora), init, recipe, parallel, microbatches, meshes.pp,
                          torch.device("cpu"), task, hooks=PIPELINE_HOOKS)

    def frozen_copy() -> nn.Module:  # the reference: another model, staged like the policy
        parts, _ = build_stage_parts(lambda: _model(1, False), init, recipe, parallel, microbatches, meshes.pp,
                                     torch.device("cpu"), hooks=PIPELINE_HOOKS)
        return nn.ModuleList(parts).requires_grad_(False)

    objective.attach(FrozenModels(None, frozen_copy, lora, None, pipe))
    optimizer = torch.optim.SGD([p for part in pipe.parts for p in part.parameters() if p.requires_grad], lr=0.5)
    with torch.device("meta"):
        flops_model = _model(0, False)
    record: dict = {"loss": [], "metrics": [], "grads": [], "params": {}}
    for micro_batches in STEPS:
        mine = micro_batches if dims.dp_size == 1 else micro_batches[meshes.dp_rank::dims.dp_size]
        batches = [task.prepare(packed_pairs(pairs)) for pairs in mine]
        metrics = pipeline_forward_backward(pipe, task, batches, meshes.loss.get_group(), dims.loss_size, dims.pp,
                                            ROW_TOKENS, flops_model)
        record["loss"].append(metrics["loss"])
        record["metrics"].append({name: metrics[name] for name in PAIR_METRICS})
        record["grads"].append({name: g for part in pipe.parts for name, g in full_grads(part).items()})
        clip_and_step(pipe.parts, optimizer, None, 0.0, meshes.pp.get_group())
    record["params"] = {name: p for part in pipe.parts for name, p in full_params(part).items()}
    for part in pipe.parts:
        part.eval()
    rows = pipeline_rows([task.prepare(packed_pairs(pairs)) for pairs in EVAL], pipe.microbatches, ROW_TOKENS,
                         task.contract)
    loss, row_metrics = pipe.evaluate(rows)
    record["eval"] = (loss, [{name: float(v) for name, (v, _) in m.items()} for m in row_metrics])
    return record


def _merged(records: list[dict]) -> dict:
    """The pipeline's ranks as one record: gradients and parameters united by name, the eval of
    the rank holding the last stage."""
    out = {**records[0], "params": {}, "grads": [{} for _ in STEPS]}
    for record in records:
        assert record["loss"] == records[0]["loss"] and record["metrics"] == records[0]["metrics"], \
            "ranks disagree on the logged loss or pair metrics"
        out["params"].update(record["params"])
        for step, grads in enumerate(record["grads"]):
            out["grads"][step].update(grads)
    out["eval"] = next(record["eval"] for record in records if record["eval"][1])
    return out


def _check_eval(reference: dict, got: dict) -> None:
    loss, row_metrics = got["eval"]
    want_loss = sum(loss_sum for loss_sum, _ in reference["eval"])
    assert_parity(torch.tensor(loss), torch.tensor(want_loss), "eval loss sum")
    for name in ("rewards_margin", "rewards_accuracy", "logps_chosen"):
        got_sum = sum(metrics[name] for metrics in row_metrics)
        want = sum(metrics[name] for _, metrics in reference["eval"])
        scale = max(abs(sum(m["logps_chosen"] for _, m in reference["eval"])), 1.0) * BETA
        assert_parity(torch.tensor(got_sum), torch.tensor(want), f"eval {name}", scale=scale)


@pytest.fixture(scope="module")
def single() -> dict[bool, dict]:
    return {lora: run_distributed(_run, 1, ParallelConfig(), lora, False, OPTIONS, EVAL)[0] for lora in (False, True)}


CASES = {  # (world, schedule, pipeline micro-batches per step, lora)
    "gpipe-joined-rows": (2, "GPipe", 2, False),
    "zbv": (2, "ZBVZeroBubble", 2, False),
    "lora-1f1b": (2, "1F1B", 4, True),
    "interleaved": (2, "Interleaved1F1B", 4, False),
    "lora-zbv": (2, "ZBVZeroBubble", 4, True),
    "pp2xfsdp2-1f1b": (4, "1F1B", 2, False),
}
FAST = {"gpipe-joined-rows", "lora-1f1b"}
"""Two schedules, one with LoRA; the rest run in the full tier (about 4 s each, under load)."""


@pytest.mark.parametrize("case", [name if name in FAST else pytest.param(name, marks=pytest.mark.full)
                                  for name in CASES])
def test_dpo_pipeline_equals_one_process(single: dict[bool, dict], case: str) -> None:
    world, schedule, microbatches, lora = CASES[case]
    reference = single[lora]
    assert abs(reference["metrics"][0]["rewards_chosen"]) > 1e-2, "the reference differs from the policy"
    got = _merged(run_distributed(_pipelined, world, ParallelConfig(pp=2, pp_schedule=schedule), microbatches,
                                  lora))
    _check(reference, got)
    _check_eval(reference, got)
