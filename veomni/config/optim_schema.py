"""The ``optim`` section of a run's schema: parameter groups by recipe globs and the options of the
optimizers beyond ``train``'s (Muon's). A file of its own so ``schema.py`` stays one screenful per
section; ``veomni.config.schema`` re-exports both classes.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal


@dataclass
class ParamGroupConfig:
    """One ``optim.groups`` entry: options for the trainable parameters whose name matches ``pattern``
    (tried in order, before the family's rules and the defaults; unset options keep the run's)."""

    pattern: str = ""
    """Parameter-name glob (plan syntax: ``layers.*.mlp.*``)."""
    optimizer: str = ""
    """The registered optimizer of these parameters; empty: the run's choice."""
    lr: float | None = None
    weight_decay: float | None = None
    warmup_steps: int | None = None
    """This group's own schedule: warmup steps and the cosine floor (unset: ``train``'s)."""
    min_lr_ratio: float | None = None


@dataclass
class OptimConfig:
    """Parameter groups by recipe globs and the options of optimizers beyond ``train``'s AdamW/SGD."""

    groups: list[ParamGroupConfig] = field(default_factory=list)
    muon_lr: float = 0.0
    """Muon's learning rate; 0 takes ``train.lr`` (with ``muon_adjust_lr: match_rms_adamw`` the same
    rate serves both, as in Moonlight)."""
    muon_momentum: float = 0.95
    muon_nesterov: bool = True
    muon_ns_steps: int = 5
    muon_ns_coefficients: tuple[float, float, float] = (3.4445, -4.7750, 2.0315)
    """Newton-Schulz quintic (a, b, c): Keller Jordan's."""
    muon_eps: float = 1e-7
    muon_adjust_lr: Literal["original", "match_rms_adamw", "none"] = "match_rms_adamw"
    """Update scale per matrix [A, B]: ``original`` sqrt(max(1, A/B)) (Keller Jordan),
    ``match_rms_adamw`` 0.2 sqrt(max(A, B)) (Moonlight), ``none`` 1."""
    muon_ns_dtype: Literal["auto", "bf16", "fp32"] = "auto"
    """Precision of the Newton-Schulz iteration; auto: bf16 on GPU, fp32 on CPU."""
    muon_fallback: str = "adamw"
    """The optimizer of what Muon does not take (embeddings, heads, norms, biases)."""
    muon_split_balance: float = 1.05
    """Sharded Muon: while the owner plan's max / mean Newton-Schulz FLOPs per rank exceeds this,
    the largest matrix's iteration is split over more ranks (docs/optimizers.md); 0 never splits
    (one owner per matrix: results bit-identical to one process, at the whole-matrix balance)."""
