"""The options of the ``vae`` family: a diffusers ``AutoencoderKL`` built from config, plus training.

The architecture fields are ``AutoencoderKL``'s own (same names and meaning), so a recipe's
``model:`` section reads like the diffusers ``config.json`` the export writes. One encoder block
per entry of ``block_out_channels``; every block but the last halves the resolution, so the
spatial factor is ``2 ** (len(block_out_channels) - 1)``.
"""

from __future__ import annotations

from dataclasses import dataclass

RECONSTRUCTION_LOSSES = ("l1", "l2")


@dataclass
class VAEConfig:
    in_channels: int = 3
    out_channels: int = 3
    latent_channels: int = 4
    block_out_channels: tuple[int, ...] = (32, 64, 64)
    layers_per_block: int = 1
    norm_num_groups: int = 32
    """GroupNorm groups in every block: must divide every entry of ``block_out_channels``."""
    act_fn: str = "silu"
    mid_block_add_attention: bool = True
    sample_size: int = 32
    """Training image size: the ``frames`` dataset kind crops every image to sample_size x sample_size."""
    scaling_factor: float = 1.0
    """Written into the exported config; ``data/build_vae.py`` sets it (and ``shift_factor``) from
    the trained encoder's latents. Not used in training."""
    shift_factor: float = 0.0
    kl_weight: float = 1e-6
    """Weight of the summed KL against the summed reconstruction error (both per pixel value)."""
    reconstruction: str = "l1"
    """``l1`` (sharper, the LDM choice) or ``l2`` (squared error) reconstruction loss."""

    def __post_init__(self) -> None:
        self.block_out_channels = tuple(self.block_out_channels)
        self.validate()

    @property
    def spatial_factor(self) -> int:
        return 2 ** (len(self.block_out_channels) - 1)

    def validate(self) -> None:
        """Raise ``ValueError`` naming the first wrong field and what it accepts."""
        for name in ("in_channels", "out_channels", "latent_channels", "layers_per_block", "norm_num_groups",
                     "sample_size"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise ValueError(f"model.{name} must be a positive int, got {value!r}")
        if not self.block_out_channels or any(c <= 0 for c in self.block_out_channels):
            raise ValueError(f"model.block_out_channels must be positive ints, got {self.block_out_channels!r}")
        bad = [c for c in self.block_out_channels if c % self.norm_num_groups]
        if bad:
            raise ValueError(f"model.norm_num_groups={self.norm_num_groups} does not divide block_out_channels "
                             f"{bad}; pick a common divisor of {list(self.block_out_channels)}")
        if self.sample_size % self.spatial_factor:
            raise ValueError(f"model.sample_size={self.sample_size} must be a multiple of the spatial factor "
                             f"{self.spatial_factor} (2 ** (len(block_out_channels) - 1))")
        if self.reconstruction not in RECONSTRUCTION_LOSSES:
            raise ValueError(f"model.reconstruction must be one of {', '.join(RECONSTRUCTION_LOSSES)}, "
                             f"got {self.reconstruction!r}")
        if self.kl_weight < 0:
            raise ValueError(f"model.kl_weight must be >= 0, got {self.kl_weight!r}")

    def diffusers_config(self) -> dict:
        """The ``AutoencoderKL(**config)`` keywords of this architecture."""
        blocks = len(self.block_out_channels)
        return dict(in_channels=self.in_channels, out_channels=self.out_channels,
                    down_block_types=("DownEncoderBlock2D",) * blocks, up_block_types=("UpDecoderBlock2D",) * blocks,
                    block_out_channels=self.block_out_channels, layers_per_block=self.layers_per_block,
                    act_fn=self.act_fn, latent_channels=self.latent_channels, norm_num_groups=self.norm_num_groups,
                    sample_size=self.sample_size, scaling_factor=self.scaling_factor, shift_factor=self.shift_factor,
                    mid_block_add_attention=self.mid_block_add_attention)
