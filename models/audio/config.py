"""Configuration of the audio encoder: log-mel features -> conv stem -> transformer -> LLM width."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from models.common.encoder import HIDDEN_ACTS


@dataclass
class AudioEncoderConfig:
    """Architecture and feature settings of ``AudioEncoder`` (defaults: Whisper-base-sized).

    conv_strides: strides of the two kernel-3 conv1d layers of the stem; their product is the
      time downsampling (frames per output token), 4 by default: 10 ms frames -> 40 ms tokens.
    sample_rate / n_fft / hop_length: what ``waveform_to_features`` must be called with so
      the features match the ones the encoder was trained on (16 kHz, 25 ms window, 10 ms hop).
    """

    n_mels: int = 80
    hidden_size: int = 512
    num_layers: int = 6
    num_heads: int = 8
    intermediate_size: int = 2048
    hidden_act: str = "gelu"
    conv_strides: tuple[int, int] = (2, 2)
    out_hidden_size: int = 4096
    """Width of the LLM the audio tokens are spliced into (set it to the LLM's hidden_size)."""
    rope_theta: float = 10000.0
    norm_eps: float = 1e-5
    init_std: float = 0.02
    sample_rate: int = 16000
    n_fft: int = 400
    hop_length: int = 160
    max_frames: int = 3000
    """Longest clip in feature frames (3000 = 30 s at a 10 ms hop); longer clips are refused."""

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_heads

    def conv_output_length(self, frames: int | torch.Tensor, layers: int = 2) -> int | torch.Tensor:
        """Length after the first ``layers`` convs of the stem (kernel 3, padding 1: each gives
        ``ceil(n / stride)``); ``frames`` may be an int or a tensor of clip lengths."""
        for stride in self.conv_strides[:layers]:
            frames = (frames + stride - 1) // stride
        return frames

    @property
    def downsample(self) -> int:
        """Feature frames per output token."""
        return self.conv_strides[0] * self.conv_strides[1]

    def validate(self) -> None:
        """Raise ``ValueError`` naming the field(s) of the first impossible combination."""
        for name in (
            "n_mels",
            "hidden_size",
            "num_layers",
            "num_heads",
            "intermediate_size",
            "out_hidden_size",
            "sample_rate",
            "n_fft",
            "hop_length",
            "max_frames",
        ):
            value = getattr(self, name)
            if not isinstance(value, int) or value <= 0:
                raise ValueError(f"{name} must be a positive int, got {value!r}")
        if len(self.conv_strides) != 2 or any(
            not isinstance(s, int) or s not in (1, 2) for s in self.conv_strides
        ):
            raise ValueError(
                f"conv_strides must be two strides of 1 or 2 (downsample 1, 2 or 4), "
                f"got {self.conv_strides!r}"
            )
        if self.hidden_size % self.num_heads:
            raise ValueError(
                f"hidden_size ({self.hidden_size}) must be divisible by num_heads ({self.num_heads})"
            )
        if self.head_dim % 2:
            raise ValueError(
                f"head_dim = hidden_size / num_heads = {self.head_dim} must be even (RoPE rotates pairs)"
            )
        if self.hidden_act not in HIDDEN_ACTS:
            raise ValueError(f"hidden_act must be one of {HIDDEN_ACTS}, got {self.hidden_act!r}")
        if self.hop_length > self.n_fft:
            raise ValueError(f"hop_length ({self.hop_length}) must be <= n_fft ({self.n_fft})")
        if self.rope_theta <= 0 or self.norm_eps <= 0 or self.init_std <= 0:
            raise ValueError("rope_theta, norm_eps and init_std must be > 0")
