"""The end of a run, finished or stopped: the last checkpoint, eval and samples, then the summary
(on screen and ``summary.json``) and the final ``loss.png``.

A finished run saves its final checkpoint before its final eval, so a crash in the eval (a bug
in a family's task, say) loses no training and restarts retrain nothing. A stopped run (SIGTERM,
Ctrl-C) has saved its checkpoint at the step it stopped after; it gets the same summary, with a
line saying where it stopped and the command that resumes it.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import signal
import time

import torch

from veomni.checkpoint.manager import list_checkpoints
from veomni.parallel.sequence import full_sequence_attention
from veomni.train.generate import sample_prompt
from veomni.train.report.summary import (
    STAGE_ENV,
    RunSummary,
    format_summary,
    next_commands,
    resume_command,
    summary_record,
    training_stats,
)

logger = logging.getLogger(__name__)


class RunEnd:
    """Mixed into the ``Trainer``: uses its ``cfg``, ``step``, ``rank``, ``checkpoints``, ``reporter``,
    ``evaluate``, ``save_checkpoint``, ``last_eval``, ``baseline`` and the run's model and outputs."""

    def finish(self, history: list[dict[str, float]]) -> None:
        """Final checkpoint, eval and sample, then the summary (``history``: this run's step metrics)."""
        cfg = self.cfg
        # The checkpoint first: a crash in the final eval (a family's task, say) must not lose the
        # steps since the last periodic checkpoint, nor make the restarts train them again.
        if cfg.checkpoint.save_final and self._last_saved_step != self.step:
            self.save_checkpoint()
        if self._last_eval_step != self.step:
            eval_metrics = self.evaluate()
            if eval_metrics:
                self.reporter.log(self.step, eval_metrics)
        self.checkpoints.wait()
        if self.sample_writer is not None and self.step % cfg.train.sample_interval:
            self.write_samples()
        sample = None
        if cfg.train.sample_prompt:
            sample = sample_prompt(cfg, self.model, self.tokenizer, self.task)
        self._report(history, sample)

    def stopped_end(self, history: list[dict[str, float]]) -> None:
        """After a requested stop (its checkpoint is saved): how to resume, then the summary."""
        self.checkpoints.wait()
        how = signal.Signals(self._signal_received).name if self._signal_received else "a stop signal"
        stopped = f"{how} at step {self.step} of {self.cfg.train.max_steps}; checkpoint saved"
        resume = resume_command(self.launch, self.cfg.checkpoint.resume)
        logger.warning("stopped by %s; resume with: %s", stopped, resume)
        self._report(history, None, stopped)

    def _report(self, history: list[dict[str, float]], sample: tuple[str, str] | None, stopped: str = "") -> None:
        """Close the sinks (the final ``loss.png``), then the summary: on screen and ``summary.json``."""
        self.reporter.close()
        summary = self._summary(history, sample, stopped)
        if self.rank == 0:
            record = json.dumps(summary_record(summary), indent=2)
            (self.output_dir / "summary.json").write_text(record + "\n")
            logger.info("end of run\n%s", format_summary(summary))

    def _summary(self, history: list[dict[str, float]], sample: tuple[str, str] | None,
                 stopped: str) -> RunSummary:
        checkpoints = list_checkpoints(self.output_dir / "checkpoints")
        checkpoint = str(checkpoints[-1][1]) if checkpoints else None
        memory = "max allocated per GPU" if self.device.type == "cuda" else "max resident set per process"
        commands = next_commands(self.launch, self.step, checkpoint, self.cfg.checkpoint.resume,
                                 self.spec.hf_adapter is not None, str(self.output_dir), self.cfg.lora.rank > 0)
        if stopped:  # what to run next is the rest of this run
            commands = (("resume the run where it stopped", resume_command(self.launch, self.cfg.checkpoint.resume)),)
        loss_units = self.task.contract.loss_units_name
        return RunSummary(
            step=self.step, unit=self.unit, eval_loss=self.last_eval.get("eval_loss"), baseline=self.baseline,
            training=training_stats(history, self.unit, self.step),
            wall_s=time.perf_counter() - self._started, memory=f"{memory}, largest rank",
            output_dir=str(self.output_dir), checkpoint=checkpoint,
            next_commands=commands,
            sample=sample[1] if sample else None, sample_how=sample[0] if sample else "",
            eval_covered=self.last_eval.get(f"eval_loss_{loss_units}"), loss_units=loss_units,
            eval_batches=self.cfg.train.eval_batches,
            eval_samples=self.last_eval.get("eval_samples"),
            eval_ranks=self.dims.dp_size,
            eval_metrics={k.removeprefix("eval_"): v for k, v in self.last_eval.items()
                          if k not in ("eval_loss", "eval_baseline", f"eval_loss_{loss_units}", "eval_samples")},
            stopped=stopped, stage=os.environ.get(STAGE_ENV, ""), mfu_peak=self.peak_source,
            parameters=self.param_counts, lora=self.cfg.lora.rank > 0,
            eval_set=bool(self.cfg.data.eval_path),
        )

    def write_samples(self) -> None:
        """The family's validation samples from the current (EMA, when kept) weights, on every rank
        (sharded weights need all of them); rank 0 writes and logs them."""
        self.watchdog.beat(f"samples at step {self.step}")
        averaged = self.ema.swapped() if self.ema is not None else contextlib.nullcontext()
        was_training = self.model.training
        self.model.eval()
        with averaged, full_sequence_attention(self.model), torch.no_grad():
            files = self.sample_writer(self.model, self.step, self.output_dir / "samples", self.rank == 0)
        self.model.train(was_training)
        self.reporter.log_images(self.step, files)
