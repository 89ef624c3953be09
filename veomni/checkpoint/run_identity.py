"""What kind of run wrote a checkpoint, and whether this run can resume it.

``checkpoint.resume: auto`` resumes the newest checkpoint in ``train.output_dir``, so a run of
another kind started in the same folder (LoRA after full fine-tuning, another model size or family,
another LoRA base) would load a checkpoint that does not fit it: its keys are missing, and every
worker's ``dcp.load`` fails the same way on every restart. Each checkpoint therefore records the run
that wrote it (``run_identity``, in ``complete.json``): the model's resolved config and, for a LoRA
run, its frozen base (``frozen_base``: seed, pretrained folders, adapter shape; a full
run's checkpoint holds every weight, so its init does not matter to a resume).

The launcher compares that record with the recipe before any worker starts (``resume_problems``),
and compares the model's parameter names and shapes with the checkpoint's DCP metadata (read
without its tensors), which also covers checkpoints written before the record existed. A worker
makes the same key check before loading (``key_problems``), so a checkpoint that does not fit stops
the run once (``BadCheckpoint``) instead of restarting it.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.metadata import TensorStorageMetadata

from veomni.checkpoint.component_init import init_entries
from veomni.checkpoint.verify import COMPLETE_MARKER
from veomni.config.schema import RunConfig

IDENTITY_KEY = "run_identity"
_SHOWN = 4


def frozen_base(cfg: RunConfig) -> dict[str, Any] | None:
    """What rebuilds a LoRA run's frozen base: the model, the seed of its init, the pretrained folders
    loaded over it and the adapters' shape. None without LoRA."""
    if cfg.lora.rank <= 0:
        return None
    return {"arch": cfg.model.arch, "seed": cfg.train.seed, "pretrained": init_entries(cfg.checkpoint),
            "lora": {"rank": cfg.lora.rank, "alpha": cfg.lora.alpha, "targets": list(cfg.lora.targets),
                     "train": list(cfg.lora.train),
                     # recorded only when set: the checkpoints of runs without them still resume
                     **{k: v for k, v in (("rank_pattern", cfg.lora.rank_pattern),
                                          ("alpha_pattern", cfg.lora.alpha_pattern)) if v}}}


def run_identity(cfg: RunConfig, model_config: Any) -> dict[str, Any]:
    """The record of the kind of run ``cfg`` is, as JSON values: the model (family and every resolved
    field of ``model_config``) and a LoRA run's frozen base (None for full fine-tuning)."""
    fields = dataclasses.asdict(model_config) if dataclasses.is_dataclass(model_config) else vars(model_config)
    model = json.loads(json.dumps({"arch": cfg.model.arch, **fields}, default=str))
    return {"model": model, "lora": json.loads(json.dumps(frozen_base(cfg), default=str))}


def _flat(value: Any, prefix: str) -> dict[str, Any]:
    if isinstance(value, dict) and value:
        return {k: v for key, item in value.items() for k, v in _flat(item, f"{prefix}.{key}").items()}
    return {prefix: value}


def identity_differences(saved: dict[str, Any], ours: dict[str, Any]) -> list[str]:
    """How the run that wrote a checkpoint differs from this one, one phrase per difference."""
    if (saved["lora"] is None) != (ours["lora"] is None):
        trained = {True: "the whole model (full fine-tuning)", False: "LoRA adapters"}
        return [f"it was written by a run that trained {trained[saved['lora'] is None]}, and this run trains "
                f"{trained[ours['lora'] is None]}"]
    flat_saved, flat_ours = _flat(saved, "run"), _flat(ours, "run")
    return [f"{key.removeprefix('run.').replace('lora.lora.', 'lora.')}: checkpoint {flat_saved.get(key)!r}, "
            f"recipe {flat_ours.get(key)!r}"
            for key in sorted(flat_saved.keys() | flat_ours.keys()) if flat_saved.get(key) != flat_ours.get(key)]


def stored_shapes(checkpoint: Path) -> dict[str, tuple[int, ...] | None]:
    """The checkpoint's keys (``model.<parameter>``, ``optim...``) with their tensor shapes (None for
    a plain value), from its DCP metadata: no tensor is read."""
    metadata = dcp.FileSystemReader(str(checkpoint)).read_metadata().state_dict_metadata
    return {key: tuple(entry.size) if isinstance(entry, TensorStorageMetadata) else None
            for key, entry in metadata.items()}


def key_problems(checkpoint: Path, wanted: dict[str, tuple[int, ...]],
                 stored: dict[str, tuple[int, ...] | None] | None = None) -> list[str]:
    """What of the model entries ``wanted`` (``{name: shape}``, without the ``model.`` prefix) the
    checkpoint lacks or holds in another shape."""
    stored = stored_shapes(checkpoint) if stored is None else stored
    missing = sorted(name for name in wanted if f"model.{name}" not in stored)
    reshaped = sorted(f"{name} {list(stored[f'model.{name}'])} in the checkpoint, {list(shape)} here"
                      for name, shape in wanted.items()
                      if f"model.{name}" in stored and stored[f"model.{name}"] != tuple(shape))
    problems = []
    if missing:
        more = f" and {len(missing) - _SHOWN} more" if len(missing) > _SHOWN else ""
        problems.append(f"it lacks {len(missing)} of this model's weights ({', '.join(missing[:_SHOWN])}{more})")
    if reshaped:
        problems.append(f"weights of other shapes: {'; '.join(reshaped[:_SHOWN])}")
    return problems


def wanted_weights(model: nn.Module, trainable_only: bool) -> dict[str, tuple[int, ...]]:
    """The model's entries a checkpoint of this run holds (``trainable_only``: a LoRA run's)."""
    return {name: tuple(p.shape) for name, p in model.named_parameters()
            if p.requires_grad or not trainable_only}


def mismatch_message(checkpoint: Path, problems: list[str]) -> str:
    """The refusal: which checkpoint, why it does not fit, and the two ways on."""
    return (f"{checkpoint} is a checkpoint of another kind of run: {'; '.join(problems)}. checkpoint.resume "
            "would resume it into this run, which cannot load it. Train into a new folder (train.output_dir), "
            "or set checkpoint.resume: none to start this run afresh in that folder")


def resume_problems(checkpoint: Path, cfg: RunConfig, model_config: Any, model: nn.Module) -> list[str]:
    """The launcher's check of the checkpoint a run would resume (``model``: the meta model, LoRA
    adapters added when ``lora.rank`` > 0): its recorded identity, then its keys and shapes."""
    saved = json.loads((checkpoint / COMPLETE_MARKER).read_text()).get(IDENTITY_KEY)
    problems = identity_differences(saved, run_identity(cfg, model_config)) if saved is not None else []
    if not problems:
        problems = key_problems(checkpoint, wanted_weights(model, cfg.lora.rank > 0))
    return [mismatch_message(checkpoint, problems)] if problems else []
