"""Load a run's trained model for inference, for any family, in one call:

    from veomni.inference import load_run
    model = load_run("outputs/toy_regression")       # the newest checkpoint, EMA weights if kept
    prediction = model(rows)

A family without a Hugging Face adapter (every plug-in family unless it registers one) cannot go
through ``scripts/export_hf.sh``; this is its way out of the trainer. The run's ``config.yaml``
says which family it is (its ``model.plugins`` are imported, as in training), the model is built
from the spec as in training, and the checkpoint is read in one process whatever world size or
layout wrote it (DCP resharding). The model comes back on CPU, in ``eval()`` mode. (Not re-exported
as ``veomni.load_run``: ``import veomni`` runs in every model family, which must not import the
checkpoint code's ``torch.distributed``.)
"""

from __future__ import annotations

from pathlib import Path

from torch import nn

from veomni.checkpoint.export import load_run_weights
from veomni.contract import build_model


def load_run(run_dir: str | Path, checkpoint: str | Path | None = None, prefer_ema: bool = True) -> nn.Module:
    """The trained model of the run in ``run_dir`` (its ``train.output_dir``), from its newest complete
    checkpoint or ``checkpoint``; with ``prefer_ema`` the EMA weights where the run kept them."""
    run_cfg, _, weights, _ = load_run_weights(Path(run_dir), Path(checkpoint) if checkpoint else None, prefer_ema)
    _, model = build_model(run_cfg.model.arch, run_cfg.model.options)
    model.load_state_dict(weights)
    return model.eval()
