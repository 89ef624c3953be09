"""Configuration of the video diffusion transformer.

The architecture fields mirror the init arguments of diffusers' ``WanTransformer3DModel`` one to
one (same names, same meaning), so a Wan folder's ``config.json`` reads into this dataclass and
back without a translation table. The training-only fields (initialisation, the diffusion task's
options, the cost model's nominal caption length) do not change what loaded weights compute.
"""

from __future__ import annotations

from dataclasses import dataclass, fields

QK_NORMS = ("rms_norm_across_heads",)
OBJECTIVES = ("flow", "ddpm")


@dataclass
class DiTConfig:
    """Defaults are a tiny model for CPU tests and the quick-start recipe (Wan2.1-T2V-1.3B is
    patch (1, 2, 2), 12 heads x 128, ffn 8960, 30 layers, in/out 16, text_dim 4096)."""

    patch_size: tuple[int, int, int] = (1, 2, 2)
    """(t, h, w) latent patch: a token is one ``t x h x w`` block of latent frames and pixels."""
    num_attention_heads: int = 4
    attention_head_dim: int = 32
    in_channels: int = 4
    out_channels: int = 4
    text_dim: int = 64
    """Width of the text encoder states the model cross-attends to."""
    freq_dim: int = 256
    """Width of the sinusoidal timestep features."""
    ffn_dim: int = 256
    num_layers: int = 4
    cross_attn_norm: bool = True
    """LayerNorm (with affine weights) before cross-attention; Wan uses it."""
    qk_norm: str = "rms_norm_across_heads"
    eps: float = 1e-6
    rope_max_seq_len: int = 1024
    """Longest patch grid axis diffusers precomputes RoPE for; we compute RoPE on the fly, so it
    only matters to a diffusers model loading our export."""
    image_dim: int | None = None
    """Width of the image encoder states (Wan2.1 I2V: 1280, CLIP ViT-H/14's penultimate layer);
    None: no image branch (text-to-video). Projected to the model width and attended to by every
    cross-attention through its own key/value projections (``added_kv_proj_dim``)."""
    added_kv_proj_dim: int | None = None
    """Input width of cross-attention's image key/value projections: set exactly when ``image_dim``
    is, and equal to the model width (they read the projected image states)."""
    # ----- training-only (free of a pretrained folder) -----
    init_std: float = 0.02
    objective: str = "flow"
    """``flow`` (rectified flow, velocity prediction) or ``ddpm`` (noise prediction)."""
    logit_mean: float = 0.0
    logit_std: float = 1.0
    shift: float = 1.0
    shift_base_tokens: int = 0
    text_dropout: float = 0.1
    """Probability of training a sample unconditionally (zero text states), for guidance."""
    first_frame_probability: float = 0.0
    """Probability that a clip sample (more than one latent frame) trains conditioned on its first
    frame, Wan2.2 TI2V style: the clean first-frame latent replaces the noisy one, its tokens take
    timestep 0 and leave the loss. Drawn per sample, so one row mixes T2V and I2V samples; needs a
    temporal patch of 1 (a token then holds one latent frame)."""
    text_len: int = 512
    """Nominal caption length (text tokens) the cost model assumes for ``--dry-run``."""
    image_len: int = 257
    """Nominal image encoder tokens per sample the cost model assumes for ``--dry-run`` of an
    image-to-video model (Wan2.1 I2V: CLIP ViT-H/14's 257, the class token and 16 x 16 patches)."""

    def __post_init__(self) -> None:
        self.patch_size = tuple(self.patch_size)  # YAML and config.json give lists

    @property
    def hidden_size(self) -> int:
        return self.num_attention_heads * self.attention_head_dim

    @property
    def patch_dim(self) -> int:
        """Elements of one input patch token, ``in_channels * pt * ph * pw``."""
        t, h, w = self.patch_size
        return self.in_channels * t * h * w

    @property
    def out_patch_dim(self) -> int:
        t, h, w = self.patch_size
        return self.out_channels * t * h * w

    def validate(self) -> None:
        """Raise ``ValueError`` naming the first impossible field and what would fix it."""
        if len(self.patch_size) != 3 or any(not isinstance(p, int) or p <= 0 for p in self.patch_size):
            raise ValueError(f"patch_size must be three positive ints (t, h, w), got {list(self.patch_size)}")
        for name in ("num_attention_heads", "attention_head_dim", "in_channels", "out_channels", "text_dim",
                     "freq_dim", "ffn_dim", "num_layers", "rope_max_seq_len", "text_len", "image_len"):
            value = getattr(self, name)
            if not isinstance(value, int) or value <= 0:
                raise ValueError(f"{name} must be a positive int, got {value!r}")
        if self.attention_head_dim % 2 or self.attention_head_dim < 6:
            raise ValueError(f"attention_head_dim must be even and >= 6 (3D RoPE rotates pairs on frame, height "
                             f"and width), got {self.attention_head_dim}")
        if self.freq_dim % 2:
            raise ValueError(f"freq_dim must be even (cos and sin halves), got {self.freq_dim}")
        self._validate_image_branch()
        if self.qk_norm not in QK_NORMS:
            raise ValueError(f"qk_norm={self.qk_norm!r} is not supported; Wan's is one of {QK_NORMS}")
        if self.objective not in OBJECTIVES:
            raise ValueError(f"objective must be one of {OBJECTIVES}, got {self.objective!r}")
        if self.eps <= 0 or self.init_std <= 0 or self.logit_std <= 0 or self.shift <= 0:
            raise ValueError("eps, init_std, logit_std and shift must be > 0")
        if self.shift_base_tokens < 0:
            raise ValueError(f"shift_base_tokens must be >= 0 (0: no resolution shift), got {self.shift_base_tokens}")
        if not 0.0 <= self.text_dropout < 1.0:
            raise ValueError(f"text_dropout must be in [0, 1), got {self.text_dropout}")
        if not 0.0 <= self.first_frame_probability <= 1.0:
            raise ValueError(f"first_frame_probability must be in [0, 1], got {self.first_frame_probability}")
        if self.first_frame_probability > 0 and self.patch_size[0] != 1:
            raise ValueError(f"first_frame_probability={self.first_frame_probability} needs patch_size[0] == 1 (a "
                             f"token of one latent frame, so the first frame's tokens hold nothing else), got "
                             f"patch_size={list(self.patch_size)}")

    def _validate_image_branch(self) -> None:
        if self.image_dim is not None and (not isinstance(self.image_dim, int) or self.image_dim <= 0):
            raise ValueError(f"image_dim must be a positive int or null (no image branch), got {self.image_dim!r}")
        if (self.image_dim is None) != (self.added_kv_proj_dim is None):
            raise ValueError(f"image_dim={self.image_dim!r} and added_kv_proj_dim={self.added_kv_proj_dim!r}: "
                             "set both (image-to-video) or neither (text-to-video)")
        if self.added_kv_proj_dim is not None and self.added_kv_proj_dim != self.hidden_size:
            raise ValueError(f"added_kv_proj_dim={self.added_kv_proj_dim} must equal the model width "
                             f"num_attention_heads x attention_head_dim = {self.hidden_size}: the image key/value "
                             "projections read the image states projected to that width")


TRAINING_FIELDS = ("init_std", "objective", "logit_mean", "logit_std", "shift", "shift_base_tokens", "text_dropout",
                   "first_frame_probability", "text_len", "image_len")
"""Fields that do not change what loaded weights compute (the HF adapter's ``free_fields``)."""
ARCHITECTURE_FIELDS = tuple(f.name for f in fields(DiTConfig) if f.name not in TRAINING_FIELDS)
"""The fields that are ``WanTransformer3DModel`` init arguments."""
