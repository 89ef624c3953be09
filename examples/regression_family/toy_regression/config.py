"""The options of the ``toy_regressor`` family: the keys of a recipe's ``model:`` section."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class ToyRegressorConfig:
    in_features: int = 8
    """Features per input row (the data's ``x`` columns)."""
    out_features: int = 1
    """Targets per row (the data's ``y`` columns)."""
    hidden_size: int = 32
    expansion: int = 2
    """Width of each block's inner layer, in multiples of ``hidden_size``."""
    num_blocks: int = 2
    """Residual MLP blocks: the units FSDP shards (the plan's ``blocks``)."""
    input_noise: float = 0.01
    """Standard deviation of the Gaussian noise the task adds to ``x`` (augmentation); 0 turns it off."""
    init_std: float = 0.02

    def validate(self) -> None:
        for name in ("in_features", "out_features", "hidden_size", "expansion", "num_blocks"):
            if getattr(self, name) < 1:
                raise ValueError(f"model.{name} must be >= 1, got {getattr(self, name)}")
        if self.input_noise < 0:
            raise ValueError(f"model.input_noise must be >= 0, got {self.input_noise}")
        if self.init_std <= 0:
            raise ValueError(f"model.init_std must be > 0, got {self.init_std}")
