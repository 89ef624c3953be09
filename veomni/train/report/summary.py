"""The end-of-run summary: what the run learned (eval loss against a baseline from the data), how
fast it ran, where its outputs are and what to run next, on one screen, plus the same numbers
for ``<output_dir>/summary.json``.

Pure functions from numbers to text, so the wording is tested without training; the trainer
collects the numbers (``RunEnd.finish`` in ``run_end.py``).
"""

from __future__ import annotations

import dataclasses
import itertools
import math
import os
import shlex
import statistics
import textwrap
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from veomni.checkpoint.manager import step_of
from veomni.tasks.base import Baseline
from veomni.train.report.loss_plot import PLOT_FILE, REWARD_PLOT_FILE

REPO = Path(__file__).resolve().parents[3]
STAGE_ENV = "VEOMNI_STAGE"
"""Set by a build that trains in stages (``data/build_vae.py``): the summary's title names the stage."""
WARMUP_STEPS = 3
"""Steps left out of the throughput median: the first ones pay for allocation and warm-up."""
WIDTH = 100
LABEL = 14


@dataclass(frozen=True)
class TrainingStats:
    """This run's steps (a resumed run counts from its first new step)."""

    first_step: int
    first_loss: float
    last_step: int
    last_loss: float
    throughput: float
    """Median ``<unit>s_per_s`` over ``measured_steps``."""
    mfu: float
    """Median MFU over the same steps."""
    measured_steps: tuple[int, int]
    train_s: float
    """Time spent in training steps (eval and checkpoints not included)."""
    peak_mem_gb: float


def training_stats(history: Sequence[dict[str, Any]], unit: str, last_step: int) -> TrainingStats | None:
    """From the loop's per-step metrics (one record per step, ending at ``last_step``); None when
    the run took no step (it was resumed at its last step)."""
    if not history:
        return None
    first_step = last_step - len(history) + 1
    skip = min(WARMUP_STEPS, (len(history) - 1) // 2)
    measured = history[skip:]
    return TrainingStats(
        first_step=first_step, first_loss=history[0]["loss"],
        last_step=last_step, last_loss=history[-1]["loss"],
        throughput=statistics.median(m[f"{unit}s_per_s"] for m in measured),
        mfu=statistics.median(m["mfu"] for m in measured),
        measured_steps=(first_step + skip, last_step),
        train_s=sum(m["step_time_s"] for m in history),
        peak_mem_gb=max(m["peak_mem_gb"] for m in history),
    )


@dataclass(frozen=True)
class RunSummary:
    step: int
    unit: str
    eval_loss: float | None
    """The last eval's loss (None: no eval ran, or it had no data)."""
    baseline: Baseline | None
    training: TrainingStats | None
    wall_s: float
    memory: str
    """What the peak memory measures ("max allocated per GPU", "max resident set per process")."""
    output_dir: str
    checkpoint: str | None
    """The newest complete checkpoint, None when the run saved none."""
    next_commands: tuple[tuple[str, str], ...]
    """(what it does, the command)."""
    sample: str | None = None
    """Prompt plus generated continuation, for text models with ``train.sample_prompt``."""
    sample_how: str = ""
    eval_metrics: dict[str, float] = dataclasses.field(default_factory=dict)
    """The last eval's other task metrics, without the ``eval_`` prefix (``accuracy``...)."""
    eval_covered: int | None = None
    """The loss units the last eval scored (``eval_loss_<loss units>``); None: not known."""
    loss_units: str = ""
    """What the loss averages over, plural ("tokens", "pairs": ``BatchContract.loss_units_name``);
    "" = the ``unit``'s plural."""
    eval_samples: int | None = None
    """The held-out samples the last eval scored (``eval_samples``); None: not known."""
    eval_batches: int = 0
    """``train.eval_batches``: micro-batches per data-parallel rank."""
    eval_ranks: int = 1
    """The data-parallel ranks that split the eval data."""
    stopped: str = ""
    """Why the run ended before ``train.max_steps`` ("SIGTERM at step 12 of 400"); "" when it finished."""
    stage: str = ""
    """``$VEOMNI_STAGE``: the part of a multi-stage build this run is ("stage 0 of 2: ..."); "" for a whole run."""
    parameters: tuple[int, int] | None = None
    """(trainable, all) parameters of the model; None: not known on this rank."""
    eval_set: bool = False
    """``data.eval_path`` is set: a missing eval loss then means no eval ran yet, or its data was empty."""
    lora: bool = False
    """A LoRA run: its checkpoints hold the adapters (exported merged, and as a PEFT folder)."""
    mfu_peak: str = ""
    """What MFU is measured against and where that figure came from (a spec table, a cached CPU measurement)."""


def shown(path: str | os.PathLike) -> str:
    """A path as the user would type it: relative when under the working directory."""
    path = Path(path)
    try:
        return str(path.resolve().relative_to(Path.cwd().resolve()))
    except ValueError:
        return str(path)


def _without_flags(args: Sequence[str], flags: set[str]) -> list[str]:
    """Command-line overrides with those setting ``flags`` removed (``--k v`` and ``--k=v``)."""
    out, i = [], 0
    while i < len(args):
        name = args[i].split("=", 1)[0]
        if name in flags:
            i += 1 if "=" in args[i] else 2
            continue
        out.append(args[i])
        i += 1
    return out


def resume_command(launch: Sequence[str], resume: str) -> str:
    """The command that resumes a stopped run: the one it was started with, resuming from its newest
    checkpoint (``--checkpoint.resume auto`` added unless the run already resumes automatically)."""
    recipe, *args = launch
    if resume != "auto":
        args = [*_without_flags(args, {"--checkpoint.resume"}), "--checkpoint.resume", "auto"]
    return shlex.join(["bash", shown(REPO / "scripts" / "train.sh"), recipe, *args])


def next_commands(launch: Sequence[str], step: int, checkpoint: str | None, resume: str,
                  export: bool, output_dir: str, lora: bool = False) -> tuple[tuple[str, str], ...]:
    """What to try next, built from ``launch`` (the recipe and overrides this run was started with):
    train 4x longer (resuming from ``checkpoint`` when there is one), and export it to Hugging Face
    when the family has an adapter (``export``; a LoRA run's as PEFT adapters and a merged model)."""
    recipe, *overrides = launch
    longer = 4 * max(step, 1)
    args = [*_without_flags(overrides, {"--train.max_steps", "--checkpoint.resume"}),
            "--train.max_steps", str(longer)]
    if checkpoint is not None and resume != "auto":
        args += ["--checkpoint.resume", "auto"]
    if checkpoint is not None:
        what = f"train on to step {longer}, resuming from the checkpoint of step {step_of(checkpoint)}"
    else:
        what = f"train {longer} steps (from scratch: this run saved no checkpoint)"
    commands = [(what, shlex.join(["bash", shown(REPO / "scripts" / "train.sh"), recipe, *args]))]
    if export and checkpoint is not None:
        script, target = shown(REPO / "scripts" / "export_hf.sh"), f"exported/{Path(output_dir).name}"
        peft = ["--peft", f"{target}-peft"] if lora else []
        commands.append(("export the checkpoint to a Hugging Face folder" + (" (merged) and its adapters (PEFT)"
                                                                            if lora else ""),
                         shlex.join(["bash", script, shown(checkpoint), target, *peft])))
    return tuple(commands)


def _duration(seconds: float) -> str:
    seconds = round(seconds)
    hours, rest = divmod(seconds, 3600)
    minutes, secs = divmod(rest, 60)
    if hours:
        return f"{hours}h{minutes:02d}m{secs:02d}s"
    return f"{minutes}m{secs:02d}s" if minutes else f"{secs}s"


def _rate(value: float) -> str:
    return f"{value:,.0f}" if value >= 100 else f"{value:.3g}"


def _wrapped(label: str, text: str) -> list[str]:
    return textwrap.wrap(text, WIDTH, initial_indent=label.ljust(LABEL), subsequent_indent=" " * LABEL)


def _eval_lines(s: RunSummary) -> list[str]:
    if s.eval_loss is None:
        why = ("no eval batches: data.eval_path is unset" if not s.eval_set
               else f"no eval ran before the stop at step {s.step}" if s.stopped
               else "no eval batches: the data.eval_path split gave none")
        return ["eval loss".ljust(LABEL) + f"none ({why})"]
    base = s.baseline
    if base is None or base.loss is None:
        return ["eval loss".ljust(LABEL) + f"{s.eval_loss:.4g}"] + _chance_lines(s)
    unit = f" {base.unit}" if base.unit else ""
    lines = ["eval loss".ljust(LABEL) + f"{s.eval_loss:.3f}{unit} vs {base.loss:.3f} for {base.name}"]
    gap = base.loss - s.eval_loss
    if gap > 0:
        share = f" ({gap / base.loss:.0%} lower)" if base.loss > 0 else ""
        lines.append(" " * LABEL + f"{gap:.3f}{unit} below the baseline{share}")
    else:
        lines.append(" " * LABEL + f"{-gap:.3f}{unit} above the baseline: the model does no better than "
                                   f"{base.name} yet")
    if base.perplexity:
        perplexities = f"{math.exp(s.eval_loss):,.1f} vs {math.exp(base.loss):,.1f}"
        lines.append("perplexity".ljust(LABEL) + perplexities)
    lines += _wrapped("baseline", base.meaning[:1].upper() + base.meaning[1:] + ".")
    return lines + _chance_lines(s)


def _chance_lines(s: RunSummary) -> list[str]:
    """Each eval share whose chance level the task knows, against it ("a coin: 50%")."""
    levels = s.baseline.chance if s.baseline is not None else ()
    shares = [f"{c.label} {s.eval_metrics[c.metric]:.1%} ({c.guess}: {c.level:.0%})"
              for c in levels if c.metric in s.eval_metrics]
    return _wrapped("vs chance", ", ".join(shares)) if shares else []


def _coverage_lines(s: RunSummary) -> list[str]:
    """How much of the held-out set the eval scored, and whether that depends on the process count."""
    if s.eval_covered is None:
        return []
    units = s.loss_units or f"{s.unit}s"
    scored = (f"{s.eval_samples:,} samples ({s.eval_covered:,} {units})" if s.eval_samples is not None
              else f"{s.eval_covered:,} {units}")
    if s.eval_batches == 0:
        return _wrapped("eval covered", f"{scored}: the whole held-out set (train.eval_batches 0), the same at any "
                                        "process count")
    return _wrapped("eval covered", f"{scored} of the held-out set: up to {s.eval_batches} micro-batches "
                                    f"(train.eval_batches) on each of {s.eval_ranks} data-parallel rank(s), ending "
                                    "early when a rank's share runs out (train.eval_batches 0 scores all of it)")


def _training_lines(s: RunSummary) -> list[str]:
    t = s.training
    if t is None:
        return ["train loss".ljust(LABEL) + f"no steps taken: the run was already at step {s.step}"]
    first, last = t.measured_steps
    return [
        "train loss".ljust(LABEL) + f"{t.first_loss:.3f} at step {t.first_step} -> {t.last_loss:.3f} at step "
                                    f"{t.last_step}",
        "throughput".ljust(LABEL) + f"{_rate(t.throughput)} {s.unit}s/s (median of steps {first}-{last}), "
                                    f"MFU {t.mfu:.1%}",
        *_wrapped("MFU peak", s.mfu_peak or "unknown"),
        "time".ljust(LABEL) + f"{_duration(s.wall_s)} since set-up began, {_duration(t.train_s)} of it in "
                              f"training steps",
        "peak memory".ljust(LABEL) + f"{t.peak_mem_gb:.2f} GiB ({s.memory})",
    ]


def _sample_lines(text: str) -> list[str]:
    """The sample, quoted; a run of 3 or more blank lines (a young model's favourite) as one line."""
    lines = []
    for blank, group in itertools.groupby(text.splitlines(), key=lambda line: not line.strip()):
        group = list(group)
        if blank and len(group) > 2:
            lines.append(f"  | ({len(group)} blank lines)")
        else:
            lines += [f"  | {line}" for line in group]
    return lines


def format_summary(s: RunSummary) -> str:
    out = Path(s.output_dir)
    title = f" {s.stage}: summary, {s.step} steps " if s.stage else f" run summary: {s.step} steps "
    lines = [title.center(WIDTH, "=")]
    if s.stopped:
        lines += _wrapped("stopped", s.stopped)
    lines += _eval_lines(s) + _coverage_lines(s)
    if s.eval_metrics:
        lines += _wrapped("eval metrics", ", ".join(f"{name} {value:.4g}" for name, value in s.eval_metrics.items()))
    if s.parameters is not None:
        trainable, total = s.parameters
        lines.append("parameters".ljust(LABEL) + f"{trainable:,} trained of {total:,} ({trainable / total:.2%})"
                     + (" (LoRA)" if s.lora else ""))
    lines += _training_lines(s)
    lines.append("outputs".ljust(LABEL) + f"{shown(out / 'metrics.jsonl')} (metrics of every step and eval)")
    if s.checkpoint is not None:
        lines.append(" " * LABEL + f"{shown(s.checkpoint)} (newest checkpoint)")
    lines.append(" " * LABEL + f"{shown(out / PLOT_FILE)} (training and eval loss, plotted)")
    if (out / REWARD_PLOT_FILE).is_file():
        lines.append(" " * LABEL + f"{shown(out / REWARD_PLOT_FILE)} (mean sampled reward, plotted)")
    lines.append(" " * LABEL + f"{shown(out / 'summary.json')} (these numbers)")
    if s.sample is not None:
        lines.append("sample".ljust(LABEL) + f"{s.sample_how}:")
        lines += _sample_lines(s.sample)
        if s.baseline is not None and s.baseline.loss is not None and s.eval_loss is not None \
                and s.eval_loss >= s.baseline.loss:
            lines.append("  (the eval loss is not below the baseline yet: expect little structure)")
    if s.stage:
        lines.append("next".ljust(LABEL) + "the build goes on to its next stage by itself")
    else:
        lines.append("next")
        for what, command in s.next_commands:
            lines.append(f"  {what}:")
            lines.append(f"    {command}")
        lines.append(f"  other recipes, tiny to cluster-sized: the table in {shown(REPO / 'README.md')}")
    lines.append("=" * WIDTH)
    return "\n".join(lines)


def summary_record(s: RunSummary) -> dict[str, Any]:
    """The numbers, for ``summary.json``."""
    record = dataclasses.asdict(s)
    record["next_commands"] = [{"what": what, "command": command} for what, command in s.next_commands]
    if s.training is not None:
        record["training"][f"{s.unit}s_per_s"] = record["training"].pop("throughput")
    if s.eval_loss is not None and s.baseline is not None and s.baseline.loss is not None:
        record["below_baseline"] = s.baseline.loss - s.eval_loss
        if s.baseline.perplexity:
            record["eval_perplexity"] = math.exp(s.eval_loss)
            record["baseline_perplexity"] = math.exp(s.baseline.loss)
    return record
