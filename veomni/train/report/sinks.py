"""Where metrics go: metrics.jsonl always; wandb and TensorBoard on request; a progress bar
on an interactive terminal, periodic log lines otherwise; every eval as its own line (loss,
baseline, the task's metrics) and a redrawn ``loss.png``. While the bar is up, log lines are
printed above it (never on its line). Only rank 0 reports."""

from __future__ import annotations

import contextlib
import json
import logging
import os
import sys
from pathlib import Path
from typing import Any

from veomni.train.report.loss_plot import write_loss_plot

logger = logging.getLogger(__name__)


class MetricsReporter:
    def __init__(self, output_dir: Path, log_cfg, run_config: dict[str, Any], total_steps: int,
                 start_step: int, enabled: bool, throughput_key: str = "tokens_per_s") -> None:
        """``throughput_key``: the metric the progress bar shows as speed (named after the task's unit)."""
        self.enabled = enabled
        self.output_dir = output_dir
        self._redirect = contextlib.ExitStack()
        self.throughput_key = throughput_key
        self.interval = max(1, log_cfg.interval)
        self._jsonl = None
        self._wandb = None
        self._tb = None
        self._bar = None
        if not enabled:
            return
        self._jsonl = open(output_dir / "metrics.jsonl", "a", buffering=1)
        if log_cfg.wandb:
            import wandb

            mode = "online" if os.environ.get("WANDB_API_KEY") else "offline"
            self._wandb = wandb.init(project=log_cfg.wandb_project, dir=str(output_dir), config=run_config,
                                     mode=mode, resume="allow", name=output_dir.name)
            logger.info("wandb logging (%s) under %s", mode, output_dir)
        if log_cfg.tensorboard:
            from torch.utils.tensorboard import SummaryWriter

            self._tb = SummaryWriter(log_dir=str(output_dir / "tensorboard"))
        if log_cfg.progress_bar and sys.stderr.isatty():
            from tqdm import tqdm
            from tqdm.contrib.logging import logging_redirect_tqdm

            self._bar = tqdm(total=total_steps, initial=start_step, desc="train", dynamic_ncols=True)
            self._redirect.enter_context(logging_redirect_tqdm())

    def log(self, step: int, metrics: dict[str, Any]) -> None:
        if not self.enabled:
            return
        record = {"step": step, **metrics}
        self._jsonl.write(json.dumps(record) + "\n")
        numeric = {k: v for k, v in metrics.items() if isinstance(v, (int, float))}
        if self._wandb is not None:
            self._wandb.log(numeric, step=step)
        if self._tb is not None:
            for key, value in numeric.items():
                self._tb.add_scalar(key, value, step)
        if self._bar is not None and "loss" in metrics:
            self._bar.update(step - self._bar.n)
            self._bar.set_postfix({"loss": f"{metrics['loss']:.3f}",
                                   self.throughput_key: f"{metrics[self.throughput_key]:.0f}",
                                   "mfu": f"{metrics['mfu']:.1%}"})
        elif step % self.interval == 0 and "loss" in metrics:
            # lists (e.g. MoE tokens per expert, layers x experts) go to metrics.jsonl only
            logger.info("step %d  %s", step, "  ".join(f"{k}={_fmt(v)}" for k, v in metrics.items()
                                                       if not isinstance(v, list) and not k.startswith("eval_")))
        if "eval_loss" in metrics:
            logger.info("%s", eval_line(step, metrics))
            self.write_plot()

    def write_plot(self) -> Path | None:
        """Redraw ``loss.png`` from ``metrics.jsonl``; its path (None on ranks that do not report)."""
        if not self.enabled:
            return None
        self._jsonl.flush()
        return write_loss_plot(self.output_dir)

    def log_images(self, step: int, files: dict[str, Path]) -> None:
        """Images a family wrote (validation samples) to wandb and TensorBoard; their paths to the log."""
        if not self.enabled or not files:
            return
        logger.info("step %d  samples: %s", step, "  ".join(str(path) for path in files.values()))
        if self._wandb is not None:
            import wandb

            self._wandb.log({f"samples/{name}": wandb.Image(str(path)) for name, path in files.items()}, step=step)
        if self._tb is not None:
            import numpy as np
            from PIL import Image

            for name, path in files.items():
                with Image.open(path) as image:
                    self._tb.add_image(f"samples/{name}", np.asarray(image.convert("RGB")), step, dataformats="HWC")

    def close(self) -> None:
        """End of a run (finished or stopped): the final plot, then the sinks."""
        if self._jsonl is not None:
            self.write_plot()
        if self._bar is not None:
            self._bar.close()
        self._redirect.close()
        if self._jsonl is not None:
            self._jsonl.close()
        if self._tb is not None:
            self._tb.close()
        if self._wandb is not None:
            self._wandb.finish()


def eval_line(step: int, metrics: dict[str, Any]) -> str:
    """One eval as a line: ``eval at step 200: loss 5.716 (baseline 5.752, 0.036 below)  accuracy=0.95``."""
    loss = metrics["eval_loss"]
    line = f"eval at step {step}: loss {loss:.4f}"
    if "eval_baseline" in metrics:
        baseline = metrics["eval_baseline"]
        side = "below" if loss < baseline else "above"
        line += f" (baseline {baseline:.4f}, {abs(baseline - loss):.4f} {side})"
    others = [f"{k.removeprefix('eval_')}={_fmt(v)}" for k, v in metrics.items()
              if k.startswith("eval_") and k not in ("eval_loss", "eval_baseline") and not isinstance(v, list)]
    return "  ".join([line, *others])


def _fmt(value: Any) -> str:
    if isinstance(value, float):
        return f"{value:.4g}"
    return str(value)
