"""What a run shows and leaves behind: an eval line per eval, ``loss.png``, a stage's summary, the
CPU peak MFU is measured against, and the final checkpoint saved before the final eval."""

import dataclasses
import json
import logging
from pathlib import Path

import torch
from PIL import Image

from harness.gloo_ranks import run_distributed
from tests.trainer_utils import tiny_run_config
from veomni.checkpoint.manager import list_checkpoints
from veomni.config.schema import LogConfig
from veomni.tasks.lm import LanguageModelingTask
from veomni.train.report import cpu_peak
from veomni.train.report.sinks import MetricsReporter, eval_line
from veomni.train.report.summary import RunSummary, format_summary
from veomni.train.trainer import Trainer


def test_an_eval_line_has_the_loss_the_baseline_and_the_task_metrics():
    line = eval_line(200, {"loss": 2.0, "eval_loss": 5.716, "eval_baseline": 5.752, "eval_accuracy": 0.956})
    assert line == "eval at step 200: loss 5.7160 (baseline 5.7520, 0.0360 below)  accuracy=0.956"


def test_every_eval_is_logged_and_plotted(tmp_path, caplog):
    reporter = MetricsReporter(tmp_path, LogConfig(progress_bar=False, interval=1000), {}, 10, 0, enabled=True)
    with caplog.at_level(logging.INFO, logger="veomni.train.report.sinks"):
        for step in range(1, 5):
            metrics = {"loss": 6.0 - step, "tokens_per_s": 1.0, "mfu": 0.1}
            if step % 2 == 0:
                metrics.update(eval_loss=5.5 - step, eval_baseline=5.0)
            reporter.log(step, metrics)
    reporter.close()
    assert [r.message.split(":")[0] for r in caplog.records] == ["eval at step 2", "eval at step 4"]
    with Image.open(tmp_path / "loss.png") as image:
        assert image.size == (900, 520)
        # the eval points are drawn in their colour (red), the training loss in blue
        colours = {colour for _, colour in image.getcolors(maxcolors=100_000)}
    assert (214, 39, 40) in colours and (31, 119, 180) in colours


def test_a_single_eval_draws_every_series_the_legend_names(tmp_path):
    """After one eval, the eval loss and its baseline are one point each: both are drawn."""
    reporter = MetricsReporter(tmp_path, LogConfig(progress_bar=False, interval=1000), {}, 10, 0, enabled=True)
    reporter.log(1, {"loss": 6.0, "tokens_per_s": 1.0, "mfu": 0.1})
    reporter.log(2, {"loss": 5.0, "tokens_per_s": 1.0, "mfu": 0.1, "eval_loss": 5.5, "eval_baseline": 6.5})
    reporter.close()
    with Image.open(tmp_path / "loss.png") as image:
        plot = image.crop((70, 30, 870, 470))  # inside the frame: the legend below it is text in every colour
        colours = {colour for _, colour in plot.getcolors(maxcolors=100_000)}
    assert {(31, 119, 180), (214, 39, 40), (120, 120, 120)} <= colours


def test_an_rl_run_plots_its_reward_and_others_do_not(tmp_path):
    """``reward.png`` holds the rising ``reward_mean`` line (low on the left, high on the right);
    a run without rewards leaves none."""
    (tmp_path / "rl").mkdir(), (tmp_path / "sft").mkdir()
    reporter = MetricsReporter(tmp_path / "rl", LogConfig(progress_bar=False, interval=1000), {}, 10, 0, enabled=True)
    for step in range(1, 5):
        reporter.log(step, {"loss": 0.0, "tokens_per_s": 1.0, "mfu": 0.1, "reward_mean": step / 4})
    reporter.close()
    with Image.open(tmp_path / "rl" / "reward.png") as image:
        rows = [y for y in range(30, 470) if image.getpixel((75, y)) == (31, 119, 180)]
        rows_right = [y for y in range(30, 470) if image.getpixel((865, y)) == (31, 119, 180)]
    assert rows and rows_right and min(rows) > max(rows_right)  # image rows grow downwards
    plain = MetricsReporter(tmp_path / "sft", LogConfig(progress_bar=False, interval=1000), {}, 10, 0, enabled=True)
    plain.log(1, {"loss": 1.0, "tokens_per_s": 1.0, "mfu": 0.1})
    plain.close()
    assert (tmp_path / "sft" / "loss.png").is_file() and not (tmp_path / "sft" / "reward.png").exists()


def test_cpu_peak_is_measured_once_per_machine(tmp_path, monkeypatch):
    monkeypatch.setenv(cpu_peak.CACHE_ENV, str(tmp_path))
    first, how_first = cpu_peak.cached_cpu_peak_flops()
    second, how_second = cpu_peak.cached_cpu_peak_flops()
    assert first == second and "measured now" in how_first and "cached in" in how_second
    assert str(tmp_path / cpu_peak.CACHE_FILE) in how_second
    assert list(json.loads((tmp_path / cpu_peak.CACHE_FILE).read_text())) == [cpu_peak.machine_key(
        torch.get_num_threads())]


def test_a_stage_summary_says_so_states_eval_coverage_and_suggests_nothing(tmp_path):
    summary = RunSummary(step=6, unit="token", baseline=None, training=None, wall_s=1.0,
                         memory="m", output_dir=str(tmp_path), checkpoint=None,
                         next_commands=(("train on", "bash scripts/train.sh r.yaml"),),
                         stage="stage 0 of 2 (the VAE)", stopped="SIGTERM at step 6 of 10; checkpoint saved",
                         eval_loss=0.5, eval_covered=1024, eval_batches=8, eval_ranks=2)
    text = format_summary(summary)
    words = " ".join(text.split())  # the summary wraps long lines
    assert "1,024 tokens of the held-out set: up to 8 micro-batches (train.eval_batches) on each of 2" in words
    whole = " ".join(format_summary(dataclasses.replace(summary, eval_batches=0, eval_samples=37)).split())
    assert "37 samples (1,024 tokens): the whole held-out set (train.eval_batches 0), the same at any process" in whole
    assert "stage 0 of 2 (the VAE): summary, 6 steps" in text and "train on" not in text
    assert "SIGTERM at step 6 of 10" in text


class _EvalCrashes(LanguageModelingTask):
    def baseline_stats(self, batch):
        raise RuntimeError("a bug in the family's eval")


def _train_into_a_crashing_final_eval(rank, world, tmp):
    cfg = tiny_run_config(Path(tmp), max_steps=2)
    cfg.checkpoint.interval = 0
    trainer = Trainer(cfg, task=_EvalCrashes())
    try:
        trainer.train()
    except RuntimeError as exc:
        return str(exc)
    return None


def test_the_final_checkpoint_is_saved_before_the_final_eval(tmp_path):
    assert run_distributed(_train_into_a_crashing_final_eval, 1, str(tmp_path)) == ["a bug in the family's eval"]
    assert [step for step, _ in list_checkpoints(tmp_path / "out" / "checkpoints")] == [2]


class _RecordsTraining(LanguageModelingTask):
    seen: list[bool] = []

    def prepare(self, batch, generator=None, training=True):
        self.seen.append(training)
        return batch


def _flags_the_task_received(rank, world, tmp):
    cfg = tiny_run_config(Path(tmp), max_steps=2, eval_batches=2)
    Trainer(cfg, task=_RecordsTraining()).train()
    return _RecordsTraining.seen


def test_the_task_is_told_which_batches_are_eval_batches(tmp_path):
    """Augmentation belongs to training batches: the task's ``prepare`` gets ``training=False`` on eval's."""
    assert run_distributed(_flags_the_task_received, 1, str(tmp_path)) == [[True, True, False, False]]
