"""Metrics reach every sink: metrics.jsonl always, TensorBoard and wandb (offline) on request."""

import json
from pathlib import Path

import pytest

from harness.gloo_ranks import run_distributed
from tests.trainer_utils import tiny_run_config
from veomni.train.trainer import Trainer

pytestmark = pytest.mark.full  # whole runs / multi-rank trainers: the full tier (tests/conftest.py)


def _train(rank, world, tmp):
    cfg = tiny_run_config(Path(tmp), max_steps=2)
    cfg.log.tensorboard = True
    cfg.log.wandb = True
    Trainer(cfg).train()


def test_jsonl_tensorboard_and_offline_wandb(tmp_path):
    run_distributed(_train, 2, str(tmp_path), env={"WANDB_MODE": "offline", "WANDB_SILENT": "true"})
    out = tmp_path / "out"
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records if "loss" in r] == [1, 2]
    assert 0 < records[0]["mfu"] < 1 and records[0]["tokens_per_s_per_device"] * 2 == records[0]["tokens_per_s"]
    assert list((out / "tensorboard").glob("events.out.tfevents.*"))
    assert list((out / "wandb").glob("offline-run-*"))


def test_sample_images_reach_tensorboard_and_wandb(tmp_path, monkeypatch):
    """What a family's SampleWriter returns (validation samples) is logged as images."""
    import numpy as np
    from PIL import Image
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    from veomni.config.schema import LogConfig
    from veomni.train.report.sinks import MetricsReporter

    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    sheet = tmp_path / "sheet.png"
    Image.fromarray(np.full((6, 10, 3), 200, dtype=np.uint8)).save(sheet)
    reporter = MetricsReporter(tmp_path, LogConfig(tensorboard=True, wandb=True, progress_bar=False), {}, 10, 0,
                               enabled=True)
    reporter.log_images(3, {"contact_sheet": sheet})
    reporter.close()
    events = EventAccumulator(str(tmp_path / "tensorboard"), size_guidance={"images": 0}).Reload()
    (image,) = events.Images("samples/contact_sheet")
    assert image.step == 3 and (image.width, image.height) == (10, 6)
    assert list((tmp_path / "wandb").glob("offline-run-*/files/media/images/samples/contact_sheet_*.png"))
