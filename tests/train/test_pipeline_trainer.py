"""The trainer driving pipeline schedules: same losses as one process, checkpoints that move
between pipeline sizes, and bad pipeline settings rejected before any work."""

import re
import shutil
from pathlib import Path

import pytest

from harness.gloo_ranks import run_distributed
from tests.parity_utils import assert_scalar_parity, assert_series_parity
from tests.trainer_utils import tiny_run_config
from veomni.config.schema import ParallelConfig
from veomni.parallel.pipeline.layout import PipelineConfigError, check_pipeline
from veomni.tasks.base import LossOutput
from veomni.tasks.lm import LanguageModelingTask
from veomni.tasks.node import correct_count
from veomni.train.trainer import Trainer

pytestmark = pytest.mark.full  # whole runs / multi-rank trainers: the full tier (tests/conftest.py)


def _config(tmp: str, pp: int, schedule: str = "1F1B", tied: bool = False, **train):
    cfg = tiny_run_config(Path(tmp), grad_accum=4, **train)
    cfg.model.options.update(num_layers=4, tie_embeddings=tied)
    cfg.parallel = ParallelConfig(pp=pp, pp_schedule=schedule)
    return cfg


def _train(rank, world, tmp, pp, schedule, optimizer):
    history = Trainer(_config(tmp, pp, schedule, max_steps=3, optimizer=optimizer)).train()
    return [m["loss"] for m in history if "loss" in m], [m["grad_norm"] for m in history if "grad_norm" in m]


@pytest.mark.parametrize("schedule", ["1F1B", "ZBVZeroBubble"])
def test_trainer_pp2_matches_one_process(tmp_path, schedule):
    """Same seed, data and steps (SGD, clipping on): losses and clipped grad norms agree."""
    ref_loss, ref_norm = run_distributed(_train, 1, str(tmp_path / "a"), 1, "1F1B", "sgd")[0]
    for loss, norm in run_distributed(_train, 2, str(tmp_path / "b"), 2, schedule, "sgd"):
        assert_series_parity(loss, ref_loss, "losses")
        assert_series_parity(norm, ref_norm, "grad norms")


def _losses_and_eval(rank, world, tmp, pp, max_steps):
    trainer = Trainer(_config(tmp, pp, max_steps=max_steps))
    history = trainer.train()
    return [m["loss"] for m in history if "loss" in m], trainer.evaluate()["eval_loss"], trainer.step


def _three_steps_then_stop(rank, world, tmp):
    trainer = Trainer(_config(tmp, 2, max_steps=5))
    for _ in range(3):  # checkpoint.interval=3 saves after the third; the run then "dies"
        trainer.run_step()


def test_checkpoint_moves_between_pipeline_sizes(tmp_path):
    """Saved at pp=2 after 3 of 5 steps (AdamW), resumed at pp=1 and pp=4: the last two losses
    and the final eval loss equal those of the uninterrupted pp=2 run."""
    full, full_eval, _ = run_distributed(_losses_and_eval, 2, str(tmp_path / "full"), 2, 5)[0]
    saved = tmp_path / "saved"
    run_distributed(_three_steps_then_stop, 2, str(saved))
    for pp in (1, 4):
        resumed = tmp_path / f"pp{pp}"
        shutil.copytree(saved, resumed)
        losses, eval_loss, step = run_distributed(_losses_and_eval, pp, str(resumed), pp, 5)[0]
        assert step == 5
        assert_series_parity(losses, full[3:], f"pp=2 -> pp={pp} losses")
        assert_scalar_parity(eval_loss, full_eval, f"pp=2 -> pp={pp} eval loss")


@pytest.mark.parametrize("settings, grad_accum, blocks, message", [
    (dict(pp=4), 4, 2, "only 2 blocks"),
    (dict(pp=2, pp_schedule="1F1B"), 1, 4, "at least as many micro-batches as stages"),
    (dict(pp=2, pp_schedule="DualPipeV"), 2, 8, "DualPipeV needs at least as many micro-batches"),
    (dict(pp=2, pp_schedule="Interleaved1F1B"), 5, 8, "multiple of its rounds"),
    (dict(pp=2, pp_microbatches=4), 6, 4, "do not divide into parallel.pp_microbatches=4"),
    (dict(pp=2, pp_schedule="GPipe", pp_virtual_stages=2), 2, 4, "runs one stage per rank"),
    (dict(pp=2, pp_schedule="ZBVZeroBubble", pp_virtual_stages=3), 2, 8, "exactly 2 stages per rank"),
    (dict(pp=2, pp_layer_split=[1, 2]), 2, 4, "sums to 3 but the model has 4 blocks"),
    (dict(pp=2, pp_schedule="DualPipeV", activation_checkpointing="selective"), 4, 4, "selective activation"),
])
def test_bad_pipeline_settings_fail_with_a_clear_message(settings, grad_accum, blocks, message):
    with pytest.raises(PipelineConfigError, match=message):
        check_pipeline(ParallelConfig(**settings), grad_accum, num_blocks=blocks)


@pytest.mark.parametrize("overrides, world, message", [
    (["--model.num_layers", "3", "--parallel.pp", "4"], 4, "4 pipeline stages .* only 3 blocks"),
    (["--parallel.pp_schedule", "DualPipeV", "--train.grad_accum", "2"], 2,
     "DualPipeV needs at least as many micro-batches as stages"),
    (["--parallel.pp_microbatches", "3"], 2, "train.grad_accum=4 loader micro-batches do not divide"),
    (["--parallel.pp", "3"], 4, "parallel.pp=3 must be >= 1 and divide the world size 4"),
])
def test_launcher_rejects_bad_pipelines_before_any_worker(capsys, overrides, world, message):
    from veomni.launch import main

    recipe = Path(__file__).resolve().parents[2] / "recipes" / "quickstart" / "tiny_llm_pp.yaml"
    assert main([str(recipe), "--dry-run", "--world-size", str(world), *overrides]) == 2
    out = capsys.readouterr()
    assert re.search(message, out.out + out.err), out.out[-2000:] + out.err


def test_llama3_70b_pipeline_dry_run_reports_every_stage(capsys):
    """The full-size recipe plans at 128 GPUs: one memory line per pipeline rank, whose
    parameters add up to the model's (every block on exactly one stage)."""
    from veomni.launch import main

    recipe = Path(__file__).resolve().parents[2] / "recipes" / "llama3" / "llama3_70b_pp.yaml"
    assert main([str(recipe), "--dry-run", "--world-size", "128", "--gpus"]) == 0
    out = capsys.readouterr().out
    total = int(re.search(r"parameters\s+([\d,]+)", out).group(1).replace(",", ""))
    assert total == 70_553_706_496  # Llama-3-70B
    rows = re.findall(r"^\s+(\d)\s+(\d+),(\d+)\s+(\d+)\s+([\d.]+)\s+([\d.]+)\s+([\d.]+)\s+(\d+)\s+([\d.]+)\s+([\d.]+)$",
                      out, flags=re.M)
    assert [int(r[0]) for r in rows] == list(range(8))
    assert sum(int(r[3]) for r in rows) == 80
    assert sum(float(r[4]) for r in rows) == pytest.approx(total / 1e9, abs=0.01)
    assert all(float(r[9]) < 80 for r in rows), "a pipeline rank would not fit an 80 GB GPU"


def test_moe_pipeline_x_expert_parallel_dry_run(capsys):
    """Qwen3-30B-A3B planned as pp 2 x ep 8 on 64 GPUs: every block on one stage, and FSDP
    gathers only a block's local experts (an eighth of them)."""
    from veomni.launch import main

    recipe = Path(__file__).resolve().parents[2] / "recipes" / "qwen3-moe" / "qwen3_30b_a3b.yaml"
    args = [str(recipe), "--dry-run", "--world-size", "64", "--gpus", "--parallel.pp", "2"]
    assert main(args + ["--parallel.pp_schedule", "Interleaved1F1B"]) == 0
    out = capsys.readouterr().out
    assert "split its experts 8-way (ep_fsdp 4 x ep 8)" in out
    rows = re.findall(r"^\s+(\d)\s+(\d+),(\d+)\s+(\d+)\s+([\d.]+)\s+([\d.]+)\s+([\d.]+)\s+(\d+)", out, flags=re.M)
    assert sum(int(r[3]) for r in rows) == 48
    assert sum(float(r[4]) for r in rows) == pytest.approx(30.532, abs=0.01)
    block_gb = 2 * 30.5e9 / 48 / 2**30  # a whole bf16 block (experts dominate)
    assert all(float(r[6]) < 2 * block_gb for r in rows), "only the local eighth of the experts is gathered"


def test_pipeline_quickstart_recipe_trains_end_to_end(tmp_path):
    """The pp=2 quick start through train.sh (CI-sized model): steps, eval, checkpoint."""
    import json

    from tests.launch.test_launch import SMALL, train_sh

    out = tmp_path / "run"
    recipe = Path(__file__).resolve().parents[2] / "recipes" / "quickstart" / "tiny_llm_pp.yaml"
    result = train_sh(str(recipe), *SMALL, "--data.tokens_per_micro_batch", "256", "--train.max_steps", "2",
                      "--train.output_dir", str(out), "--checkpoint.interval", "0")
    assert result.returncode == 0, result.stderr[-3000:]
    assert "pp=2 (pipeline stages" in result.stderr and "1F1B: 2 stages with [1, 1] blocks" in result.stderr
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records if "loss" in r] == [1, 2] and any("eval_loss" in r for r in records)
    assert (out / "checkpoints" / "step_00000002" / "complete.json").is_file()


class _TopOneLM(LanguageModelingTask):
    """A language model task with an eval metric, as an outside family's accuracy would be."""

    def output_metrics(self, logits, labels):
        return {"top1": correct_count(logits, labels)}

    def __call__(self, model, batch):
        logits = self.forward(model, batch)
        return LossOutput(self.output_loss(logits, batch["labels"]), self.count_loss_units(batch),
                          self.output_metrics(logits, batch["labels"]))


def _eval_with_a_task_metric(rank, world, tmp, pp):
    return Trainer(_config(tmp, pp, max_steps=1), task=_TopOneLM()).evaluate()


def test_task_metrics_survive_the_pipeline(tmp_path):
    """Eval metrics come from the last stage's output (``output_metrics``) and equal one process's."""
    reference = run_distributed(_eval_with_a_task_metric, 1, str(tmp_path / "a"), 1)[0]
    assert 0 <= reference["eval_top1"] <= 1
    for result in run_distributed(_eval_with_a_task_metric, 2, str(tmp_path / "b"), 2):
        assert result["eval_top1"] == pytest.approx(reference["eval_top1"], abs=1e-9)
        assert result["eval_loss"] == pytest.approx(reference["eval_loss"], abs=1e-5)
