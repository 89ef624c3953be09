"""Where metrics go: metrics.jsonl always; wandb and TensorBoard on request; a progress bar
on an interactive terminal, periodic log lines otherwise. Only rank 0 reports."""

from __future__ import annotations

import json
import logging
import os
import sys
from pathlib import Path
from typing import Any

logger = logging.getLogger(__name__)


class MetricsReporter:
    def __init__(self, output_dir: Path, log_cfg, run_config: dict[str, Any], total_steps: int,
                 start_step: int, enabled: bool, throughput_key: str = "tokens_per_s") -> None:
        """``throughput_key``: the metric the progress bar shows as speed (named after the task's unit)."""
        self.enabled = enabled
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

            self._bar = tqdm(total=total_steps, initial=start_step, desc="train", dynamic_ncols=True)

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
        elif step % self.interval == 0 or "eval_loss" in metrics:
            # lists (e.g. MoE tokens per expert, layers x experts) go to metrics.jsonl only
            logger.info("step %d  %s", step, "  ".join(f"{k}={_fmt(v)}" for k, v in metrics.items()
                                                       if not isinstance(v, list)))

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
        if self._bar is not None:
            self._bar.close()
        if self._jsonl is not None:
            self._jsonl.close()
        if self._tb is not None:
            self._tb.close()
        if self._wandb is not None:
            self._wandb.finish()


def _fmt(value: Any) -> str:
    if isinstance(value, float):
        return f"{value:.4g}"
    return str(value)
