"""Configuration of the native-resolution ViT (Seed-ViT style) and its 2x2 merge adapter.

Defaults are the *assumed* full-size Seed-ViT: the Seed1.5-VL report gives 532M parameters,
native resolution, 14x14 patches, 2D RoPE and 2x2 average pooling + a 2-layer MLP adapter,
but not the depth, width or heads. ``num_layers=27, hidden_size=1280`` is an arithmetic fit
(``12 * L * d^2`` = 531M), not a published figure; see docs/vit.md.
"""

from __future__ import annotations

from dataclasses import dataclass

from models.common.encoder import HIDDEN_ACTS

MERGE_MODES = ("avg", "concat")
NORMS = ("layernorm", "rmsnorm")
MLPS = ("plain", "gated")
CLIP_MEAN = (0.48145466, 0.4578275, 0.40821073)
CLIP_STD = (0.26862954, 0.26130258, 0.27577711)


@dataclass
class ViTConfig:
    """Architecture and input budget of ``NativeResolutionViT``.

    merge_mode: how the ``merge_size x merge_size`` neighbouring patch features become one
      token: "avg" (Seed1.5-VL: average pooling, adapter input width ``hidden_size``) or
      "concat" (Qwen2-VL: concatenation, adapter input width ``merge_size**2 * hidden_size``).
    adapter_hidden_size: width of the adapter MLP's middle layer; None = its input width.
    min_pixels / max_pixels: per-image (per-frame) pixel budget of ``smart_resize``;
      ``max_pixels`` is a hard limit, ``min_pixels`` a floor it yields to.

    Options of the Qwen-VL towers (defaults: the Seed-ViT / Qwen2-VL tower, unchanged):
    temporal_patch_size: frames one patch spans (Qwen2-VL and Qwen2.5-VL: 2, a still image
      repeated over them); a patch then holds ``in_channels * T * p * p`` values in (C, T, p, p) order.
    norm: "layernorm" (Qwen2-VL) or "rmsnorm" (Qwen2.5-VL), in the blocks and before the merge.
    mlp: "plain" (fc1, act, fc2) or "gated" (Qwen2.5-VL: ``down(act(gate(x)) * up(x))``, with biases).
    window_size: side in pixels of the square windows the attention of most layers is confined to
      (Qwen2.5-VL: 112, i.e. 4x4 merged tokens); 0: every layer attends within whole frames.
    full_attention_layers: with windows, the layers that still attend within whole frames
      (Qwen2.5-VL's ``fullatt_block_indexes``).
    """

    patch_size: int = 14
    in_channels: int = 3
    hidden_size: int = 1280
    num_layers: int = 27
    num_heads: int = 16
    intermediate_size: int = 5120
    hidden_act: str = "gelu"
    merge_size: int = 2
    merge_mode: str = "avg"
    adapter_hidden_size: int | None = None
    out_hidden_size: int = 4096
    """Width of the LLM the merged tokens are spliced into (assumed; set it to the LLM's)."""
    rope_theta: float = 10000.0
    temporal_patch_size: int = 1
    norm: str = "layernorm"
    mlp: str = "plain"
    window_size: int = 0
    full_attention_layers: tuple[int, ...] = ()
    norm_eps: float = 1e-6
    init_std: float = 0.02
    min_pixels: int = 4 * 28 * 28
    max_pixels: int = 1024 * 28 * 28
    image_mean: tuple[float, ...] = CLIP_MEAN
    image_std: tuple[float, ...] = CLIP_STD

    def __post_init__(self) -> None:
        self.full_attention_layers = tuple(self.full_attention_layers)  # a YAML list compares as a tuple

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_heads

    @property
    def resize_factor(self) -> int:
        """Image sides are multiples of this many pixels (28 for 14 px patches merged 2x2)."""
        return self.patch_size * self.merge_size

    @property
    def patch_dim(self) -> int:
        """Values per flattened patch: ``in_channels * temporal_patch_size * patch_size**2``."""
        return self.in_channels * self.temporal_patch_size * self.patch_size**2

    @property
    def window_tokens(self) -> int:
        """Side of an attention window in merged tokens (0: no windows)."""
        return self.window_size // self.resize_factor

    @property
    def merged_dim(self) -> int:
        """Adapter input width: one merged token before the MLP."""
        return self.hidden_size * (self.merge_size**2 if self.merge_mode == "concat" else 1)

    @property
    def adapter_width(self) -> int:
        return self.adapter_hidden_size or self.merged_dim

    def validate(self) -> None:
        """Raise ``ValueError`` naming the field(s) of the first impossible combination."""
        for name in (
            "patch_size",
            "in_channels",
            "hidden_size",
            "num_layers",
            "num_heads",
            "intermediate_size",
            "merge_size",
            "out_hidden_size",
            "temporal_patch_size",
            "min_pixels",
            "max_pixels",
        ):
            value = getattr(self, name)
            if not isinstance(value, int) or value <= 0:
                raise ValueError(f"{name} must be a positive int, got {value!r}")
        if self.hidden_size % self.num_heads:
            raise ValueError(
                f"hidden_size ({self.hidden_size}) must be divisible by num_heads ({self.num_heads})"
            )
        if self.head_dim % 4:
            raise ValueError(
                f"head_dim = hidden_size / num_heads = {self.head_dim} must be divisible by 4: 2D RoPE "
                "rotates pairs of dims, half of them by the row and half by the column"
            )
        if self.adapter_hidden_size is not None and self.adapter_hidden_size <= 0:
            raise ValueError(
                f"adapter_hidden_size must be a positive int or None, got {self.adapter_hidden_size!r}"
            )
        if self.merge_mode not in MERGE_MODES:
            raise ValueError(f"merge_mode must be one of {MERGE_MODES}, got {self.merge_mode!r}")
        if self.norm not in NORMS:
            raise ValueError(f"norm must be one of {NORMS}, got {self.norm!r}")
        if self.mlp not in MLPS:
            raise ValueError(f"mlp must be one of {MLPS}, got {self.mlp!r}")
        self._validate_windows()
        if self.hidden_act not in HIDDEN_ACTS:
            raise ValueError(f"hidden_act must be one of {HIDDEN_ACTS}, got {self.hidden_act!r}")
        if self.max_pixels < self.resize_factor**2:
            raise ValueError(
                f"max_pixels ({self.max_pixels}) is below one merged token, (patch_size * merge_size)^2 = "
                f"{self.resize_factor**2}"
            )
        if self.min_pixels > self.max_pixels:
            raise ValueError(f"min_pixels ({self.min_pixels}) must be <= max_pixels ({self.max_pixels})")
        if len(self.image_mean) != self.in_channels or len(self.image_std) != self.in_channels:
            raise ValueError(
                f"image_mean and image_std need one value per channel (in_channels={self.in_channels}), "
                f"got {len(self.image_mean)} and {len(self.image_std)}"
            )
        if min(self.image_std) <= 0 or self.rope_theta <= 0 or self.norm_eps <= 0 or self.init_std <= 0:
            raise ValueError("image_std, rope_theta, norm_eps and init_std must be > 0")

    def _validate_windows(self) -> None:
        if not isinstance(self.window_size, int) or self.window_size < 0 or self.window_size % self.resize_factor:
            raise ValueError(f"window_size must be 0 (no windows) or a positive multiple of patch_size * merge_size "
                             f"= {self.resize_factor} pixels, got {self.window_size!r}")
        bad = [i for i in self.full_attention_layers if not isinstance(i, int) or not 0 <= i < self.num_layers]
        if bad:
            raise ValueError(f"full_attention_layers {bad} are not layer indices in 0..{self.num_layers - 1}")
        if self.full_attention_layers and not self.window_size:
            raise ValueError("full_attention_layers needs window_size > 0: without windows every layer attends "
                             "within whole frames already")
