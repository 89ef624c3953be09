"""Optimizers as a seat of their own: registered by name (``registry.py``; a plug-in adds one),
parameter groups chosen by rules (``groups.py``: recipe globs, the family's ``ParamRule``s, the
defaults), each group with its own learning rate and schedule (``schedule.py``), and several
optimizers per model part in one container (``container.py``) that the trainer, the pipeline's
stages, LoRA, the bad-step guard and the checkpoint manager all use. Built in: AdamW, SGD and
Muon (``muon.py``). See docs/optimizers.md."""

from veomni.optim import builtin as _builtin  # noqa: F401  (registers adamw, sgd, muon)
from veomni.optim.build import build_optimizer
from veomni.optim.container import OptimizerSet
from veomni.optim.muon import Muon, newton_schulz
from veomni.optim.registry import OptimizerEntry, get_optimizer, register_optimizer, registered_optimizers
from veomni.optim.schedule import build_scheduler, lr_multiplier

__all__ = ["Muon", "OptimizerEntry", "OptimizerSet", "build_optimizer", "build_scheduler", "get_optimizer",
           "lr_multiplier", "newton_schulz", "register_optimizer", "registered_optimizers"]
