"""The end-of-run summary: the language-modelling baseline (unigram entropy of the eval targets)
against values computed here by hand, its sum over batches and ranks, the summary's wording
from fixed numbers, and the next command it suggests, parsed back by the real config loader."""

import json
import math
import shlex
from collections import Counter
from pathlib import Path

import pytest
import torch

from harness.gloo_ranks import run_distributed
from tests.trainer_utils import tiny_run_config
from veomni.config.load import load_config
from veomni.config.schema import ParallelConfig, RunConfig
from veomni.data.build_loader import build_dataloader, load_run_tokenizer
from veomni.objectives import ObjectiveRequest, build_objective
from veomni.tasks.base import IGNORE_INDEX, Baseline
from veomni.tasks.lm import LanguageModelingTask
from veomni.tasks.mtp import MultiTokenLMTask
from veomni.train.report.baseline import add_padded, all_reduce_padded
from veomni.train.report.summary import RunSummary, format_summary, next_commands, summary_record, training_stats
from veomni.train.trainer import Trainer

REPO = Path(__file__).resolve().parents[2]


def _entropy(tokens: list[int]) -> float:
    counts = Counter(tokens)
    total = sum(counts.values())
    return -sum(c / total * math.log(c / total) for c in counts.values())


def _batch(labels: list[int], cu_seqlens: list[int]) -> dict:
    return {"labels": torch.tensor(labels), "input_ids": torch.zeros(len(labels), dtype=torch.long),
            "cu_seqlens": torch.tensor(cu_seqlens, dtype=torch.int32)}


def test_lm_baseline_is_the_unigram_entropy_of_the_targets():
    task = LanguageModelingTask()
    first, second = [5, 5, 7, IGNORE_INDEX, 9, 5], [2, IGNORE_INDEX, 7, 7]
    stats = add_padded(add_padded(None, task.baseline_stats(_batch(first, [0, 6]))),
                       task.baseline_stats(_batch(second, [0, 4])))  # ids up to 9, then up to 7: padded
    baseline = task.baseline_loss(stats)
    targets = [t for t in first + second if t != IGNORE_INDEX]
    assert baseline.loss == pytest.approx(_entropy(targets), abs=1e-12)
    assert baseline.unit == "nats" and baseline.perplexity
    assert task.baseline_loss(task.baseline_stats(_batch([IGNORE_INDEX] * 3, [0, 3]))) is None


def test_mtp_baseline_weighs_its_terms_as_the_loss_does():
    labels = [4, 6, 4, IGNORE_INDEX, 3, 3, 8, IGNORE_INDEX]  # two samples of four rows
    task = MultiTokenLMTask(mtp_weight=0.3)
    baseline = task.baseline_loss(task.baseline_stats(_batch(labels, [0, 4, 8])))
    ntp = [t for t in labels if t != IGNORE_INDEX]
    mtp = [4, 6, 3, 8]  # per sample: the label one row ahead, within the sample
    expected = _entropy(ntp) + 0.3 * len(mtp) / len(ntp) * _entropy(mtp)
    assert baseline.loss == pytest.approx(expected, abs=1e-12)


def _reduce(rank, world):
    mine = torch.tensor([1.0, 2.0]) if rank == 0 else torch.tensor([0.0, 0.0, 3.0])
    return all_reduce_padded(mine).tolist()


def test_stats_of_different_sizes_sum_over_ranks():
    assert run_distributed(_reduce, 2) == [[1.0, 2.0, 3.0]] * 2


def _train(rank, world, tmp, parallel):
    cfg = tiny_run_config(Path(tmp), max_steps=2, grad_accum=2, eval_batches=2)
    cfg.model.options.update(num_layers=2, tie_embeddings=False)
    cfg.parallel = parallel
    trainer = Trainer(cfg)
    trainer.train()
    return trainer.baseline


def _expected_entropy(tmp: Path, dp_size: int) -> float:
    """From the eval loader itself: each data-parallel rank's first ``eval_batches`` batches."""
    cfg = tiny_run_config(tmp, eval_batches=2)
    tokenizer = load_run_tokenizer(cfg.data, "packed_text")
    targets = []
    for dp_rank in range(dp_size):
        loader = iter(build_dataloader(cfg.data, "eval", tokenizer, dp_rank, dp_size, cfg.train.seed))
        for _ in range(cfg.train.eval_batches):
            targets += [t for t in next(loader)["labels"].tolist() if t != IGNORE_INDEX]
    return _entropy(targets)


@pytest.mark.parametrize("parallel, dp_size", [(ParallelConfig(), 2), (ParallelConfig(sp=2), 1),
                                              (ParallelConfig(pp=2), 1)], ids=["dp2", "sp2", "pp2"])
def test_trainer_baseline_covers_every_rank_and_both_runners(tmp_path, parallel, dp_size):
    """Two ranks: each reads its own eval batches (dp), a slice of the same rows (sp), or the same
    rows as a pipeline stage (pp); the baseline is that of the eval batches of every dp rank."""
    baselines = run_distributed(_train, 2, str(tmp_path), parallel)
    assert baselines[0] == baselines[1]
    assert baselines[0].loss == pytest.approx(_expected_entropy(tmp_path, dp_size), abs=1e-9)
    record = json.loads((tmp_path / "out" / "summary.json").read_text())
    assert record["step"] == 2 and record["eval_loss"] > 0 and record["baseline"]["loss"] == baselines[0].loss
    assert record["checkpoint"].endswith("step_00000002")


def _summary(**changes) -> RunSummary:
    history = [{"loss": 9.0 - i, "tokens_per_s": 1000.0 + 100 * i, "mfu": 0.2, "step_time_s": 2.0,
                "peak_mem_gb": 1.0 + i / 10} for i in range(7)]
    fields = dict(
        step=107, unit="token", eval_loss=2.91,
        baseline=Baseline(6.12, "token frequencies alone", "the loss of a model that knows only how often "
                          "each token occurs; below it, the model uses context", "nats", perplexity=True),
        training=training_stats(history, "token", 107), wall_s=238.4, memory="max resident set per process",
        output_dir="/runs/tiny", checkpoint="/runs/tiny/checkpoints/step_00000107",
        next_commands=(("train on", "bash scripts/train.sh r.yaml --train.max_steps 428"),),
        sample="def f():\n    return 1", sample_how="greedy, 5 tokens")
    fields.update(changes)
    return RunSummary(**fields)


def test_training_stats_skip_the_first_steps_of_this_run():
    stats = _summary().training
    assert (stats.first_step, stats.first_loss, stats.last_step, stats.last_loss) == (101, 9.0, 107, 3.0)
    assert stats.measured_steps == (104, 107)
    assert stats.throughput == 1450.0  # median of 1300, 1400, 1500, 1600
    assert stats.train_s == 14.0 and stats.peak_mem_gb == pytest.approx(1.6)


def test_summary_text_reads_the_numbers_against_the_baseline():
    text = format_summary(_summary())
    lines = text.splitlines()
    assert len(lines) <= 30 and all(len(line) <= 100 for line in lines)
    assert "eval loss     2.910 nats vs 6.120 for token frequencies alone" in text
    assert "3.210 nats below the baseline (52% lower)" in text
    assert f"perplexity    {math.exp(2.91):.1f} vs {math.exp(6.12):.1f}" in text
    assert "train loss    9.000 at step 101 -> 3.000 at step 107" in text
    assert "throughput    1,450 tokens/s (median of steps 104-107), MFU 20.0%" in text
    assert "time          3m58s since set-up began, 14s of it in training steps" in text
    assert "peak memory   1.60 GiB (max resident set per process)" in text
    assert "/runs/tiny/metrics.jsonl" in text and "/runs/tiny/checkpoints/step_00000107" in text
    assert "  | def f():\n  |     return 1\nnext" in text
    assert "    bash scripts/train.sh r.yaml --train.max_steps 428" in text


def test_summary_says_when_the_model_is_not_below_the_baseline():
    text = format_summary(_summary(eval_loss=6.5))
    assert "  |     return 1\n  (the eval loss is not below the baseline yet: expect little structure" in text
    assert "0.380 nats above the baseline: the model does no better than token frequencies alone yet" in text
    assert "eval loss     none" in format_summary(_summary(eval_loss=None, baseline=None))


def test_summary_says_why_there_is_no_eval_loss():
    """An interrupted run with data.eval_path set ran no eval yet: not 'eval_path is unset'."""
    def why(**changes) -> str:
        text = format_summary(_summary(eval_loss=None, baseline=None, **changes))
        return next(line for line in text.splitlines() if line.startswith("eval loss"))

    assert why(eval_set=True, stopped="SIGTERM at step 107 of 400") == \
        "eval loss     none (no eval ran before the stop at step 107)"
    assert why(eval_set=False, stopped="SIGTERM at step 107 of 400") == \
        "eval loss     none (no eval batches: data.eval_path is unset)"
    assert why(eval_set=True) == "eval loss     none (no eval batches: the data.eval_path split gave none)"


def test_summary_lists_the_tasks_other_eval_metrics():
    text = format_summary(_summary(eval_metrics={"accuracy": 0.83217, "test_accuracy": 0.845}))
    assert "\neval metrics  accuracy 0.8322, test_accuracy 0.845\ntrain loss" in text
    assert "eval metrics" not in format_summary(_summary())
    assert summary_record(_summary(eval_metrics={"accuracy": 0.5}))["eval_metrics"] == {"accuracy": 0.5}


def test_a_preference_summary_states_pair_accuracy_against_a_coin_and_counts_pairs():
    """The DPO task's own baseline names its chance level; its loss units are pairs, not tokens."""
    cfg = RunConfig()
    cfg.train.objective = "dpo"
    task = build_objective(ObjectiveRequest(cfg, LanguageModelingTask())).task
    baseline = task.baseline_loss(torch.tensor([12.0], dtype=torch.float64))
    pairs = dict(eval_loss=0.35, baseline=baseline, eval_covered=12, eval_samples=24,
                 loss_units=task.contract.loss_units_name, sample=None)
    text = format_summary(_summary(eval_metrics={"rewards_accuracy": 0.83333, "rewards_margin": 1.25}, **pairs))
    assert "\nvs chance     held-out pair accuracy 83.3% (a coin: 50%)\n" in text
    assert "eval covered  24 samples (12 pairs): the whole held-out set" in text and "tokens)" not in text
    assert "vs chance" not in format_summary(_summary(eval_metrics={"rewards_margin": 1.25}, **pairs))
    assert "vs chance" not in format_summary(_summary(eval_metrics={"accuracy": 0.8}))  # no chance level named


def test_a_summary_with_the_nll_term_keeps_the_chance_line_without_a_loss_baseline():
    """rpo_alpha's NLL term has no model-free loss; the pair accuracy's coin stays in the summary."""
    cfg = RunConfig()
    cfg.train.objective, cfg.preference.rpo_alpha = "dpo", 1.0
    task = build_objective(ObjectiveRequest(cfg, LanguageModelingTask())).task
    baseline = task.baseline_loss(torch.tensor([12.0], dtype=torch.float64))
    assert baseline.loss is None
    summary = _summary(eval_loss=0.35, baseline=baseline, eval_metrics={"rewards_accuracy": 0.75}, sample=None)
    text = format_summary(summary)
    assert "\neval loss     0.35\n" in text and "below the baseline" not in text
    assert "\nvs chance     held-out pair accuracy 75.0% (a coin: 50%)\n" in text
    assert "below_baseline" not in summary_record(summary)


def test_summary_sample_shows_runs_of_blank_lines_as_one():
    text = format_summary(_summary(sample="def f():\n\n    \n\n\n  x\n\n\ny"))
    assert "  | def f():\n  | (4 blank lines)\n  |   x\n  | \n  | \n  | y\n" in text


def test_summary_record_holds_the_numbers():
    record = json.loads(json.dumps(summary_record(_summary())))
    assert record["eval_loss"] == 2.91 and record["baseline"]["loss"] == 6.12
    assert record["below_baseline"] == pytest.approx(3.21)
    assert record["eval_perplexity"] == pytest.approx(math.exp(2.91))
    assert record["training"]["tokens_per_s"] == 1450.0
    assert record["next_commands"][0]["command"].endswith("--train.max_steps 428")


def test_next_command_resumes_the_same_run_with_more_steps(tmp_path, monkeypatch):
    monkeypatch.chdir(REPO)
    recipe = "recipes/quickstart/tiny_llm.yaml"
    launch = [recipe, "--train.max_steps", "100", "--train.output_dir", str(tmp_path),
              "--checkpoint.resume=none", "--train.sample_prompt", "x = f(1) and g(2)"]
    checkpoint = str(tmp_path / "checkpoints" / "step_00000100")
    commands = dict(next_commands(launch, 100, checkpoint, "none", True, str(tmp_path)))
    what, command = next((w, c) for w, c in commands.items() if w.startswith("train on"))
    assert what == "train on to step 400, resuming from the checkpoint of step 100"
    argv = shlex.split(command)
    assert argv[:3] == ["bash", "scripts/train.sh", recipe]
    cfg = load_config(argv[2], argv[3:])
    assert cfg.train.max_steps == 400 and cfg.checkpoint.resume == "auto"
    assert cfg.train.output_dir == str(tmp_path) and cfg.train.sample_prompt == "x = f(1) and g(2)"
    export = commands["export the checkpoint to a Hugging Face folder"]
    assert shlex.split(export)[1:] == ["scripts/export_hf.sh", checkpoint, f"exported/{tmp_path.name}"]

    fresh = dict(next_commands([recipe], 100, None, "auto", True, str(tmp_path)))
    assert "train 400 steps (from scratch: this run saved no checkpoint)" in fresh
    assert not any("export" in what for what in fresh)
