"""A LoRA run's weights from its checkpoint: the base rebuilt as the run built it, the trained
tensors (adapters, ``lora.train`` modules) read over it.

A LoRA checkpoint holds only what trains (``CheckpointManager(trainable_only=True)``), so every
start of the run, its export, its evaluation and its samples rebuild the frozen base from its
recipe: the run's seed, the family's init and the pretrained folders of
``checkpoint.init_from_hf`` / ``checkpoint.init``. The checkpoint records that recipe
(``frozen_base``) and a reader refuses a config that describes another.
"""

from __future__ import annotations

import functools
import json
import logging
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch import nn

from veomni.adapters.lora import adapted_model, is_adapter_name
from veomni.adapters.peft_io import init_adapters
from veomni.checkpoint.component_init import init_entries, load_components
from veomni.checkpoint.manager import COMPLETE_MARKER, EMA_APP_KEY
from veomni.checkpoint.run_identity import frozen_base
from veomni.config.schema import RunConfig
from veomni.contract import build_config, get_model_spec, load_plugins

logger = logging.getLogger(__name__)


def loads_pretrained(cfg: RunConfig, resuming: bool) -> bool:
    """Whether a start of the run loads the pretrained folders (``checkpoint.init_from_hf`` /
    ``checkpoint.init``): a fresh run does, and a LoRA run at every start, its resumes included (its
    checkpoints hold no base). The workers load by it and the launcher checks by it."""
    return not resuming or cfg.lora.rank > 0


def rebuild_lora_base(run_cfg: RunConfig) -> tuple[Any, nn.Module]:
    """(model config, the adapted CPU model as the run's rank 0 built it before its first step): the
    seeded init, the pretrained folders over it, PEFT's adapter init (no ``lora.init_from_peft``)."""
    load_plugins(run_cfg.model.plugins)
    spec = get_model_spec(run_cfg.model.arch)
    model_cfg = build_config(run_cfg.model.arch, run_cfg.model.options)
    torch.manual_seed(run_cfg.train.seed)  # the base exactly as the run's rank 0 built it
    model = adapted_model(functools.partial(spec.instantiate, model_cfg), run_cfg.lora)
    model.init_weights()
    load_components(model, init_entries(run_cfg.checkpoint), is_adapter_name)
    init_adapters(model, run_cfg.lora, spec.hf_adapter, model_cfg, resuming=True)
    return model_cfg, model


def load_lora_checkpoint(checkpoint: Path, run_cfg: RunConfig, averaged: set[str] = frozenset()
                         ) -> tuple[Any, nn.Module]:
    """(model config, the adapted CPU model holding the checkpoint's trained values); the entries in
    ``averaged`` are read from the checkpoint's weight EMA instead. ValueError when the checkpoint's
    base is not the one ``run_cfg`` describes."""
    saved = json.loads((checkpoint / COMPLETE_MARKER).read_text()).get("frozen_base")
    if saved != frozen_base(run_cfg):
        raise ValueError(f"{checkpoint} was trained on the base {saved}, but its run config describes "
                         f"{frozen_base(run_cfg)}: pass the run's own config.yaml")
    model_cfg, model = rebuild_lora_base(run_cfg)
    trained = {name: p.detach().clone() for name, p in model.named_parameters() if p.requires_grad}
    state: dict[str, Any] = {"model": {k: v for k, v in trained.items() if k not in averaged}}
    if averaged:
        state["app"] = {EMA_APP_KEY: {k: v for k, v in trained.items() if k in averaged}}
    dcp.load(state, checkpoint_id=str(checkpoint))
    values = {**state["model"], **(state["app"][EMA_APP_KEY] if averaged else {})}
    model.load_state_dict(values, strict=False)
    logger.info("%s: %d trained tensors over the base rebuilt from its recipe", checkpoint, len(values))
    return model_cfg, model
