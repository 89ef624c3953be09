"""Tiny stand-ins for the video pieces sampling tests need, built from config with random weights:
a diffusers ``WanTransformer3DModel`` behind the DiT's ``forward_video`` call, an ``AutoencoderKL``
with spatial factor 4, a ``UMT5EncoderModel`` and a word-level tokenizer, saved as a latent split
manifest names them (data/build_video_latents.py's format)."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

WORDS = ["a", "red", "green", "blue", "circle", "square", "triangle", "moves", "left", "right", "up", "down",
         "small", "large", "slowly", "quickly", "still"]
TEXT_DIM = 64
LATENT_CHANNELS = 4


class WanStandIn(nn.Module):
    """diffusers' Wan transformer with the DiT's call: ``forward_video(latents, timestep, text)``."""

    def __init__(self) -> None:
        super().__init__()
        from diffusers import WanTransformer3DModel

        self.wan = WanTransformer3DModel(patch_size=(1, 2, 2), num_attention_heads=2, attention_head_dim=8,
                                         in_channels=LATENT_CHANNELS, out_channels=LATENT_CHANNELS,
                                         text_dim=TEXT_DIM, freq_dim=16, ffn_dim=32, num_layers=1,
                                         rope_max_seq_len=32)

    def forward_video(self, latents, timestep, encoder_hidden_states):
        return self.wan(latents, timestep, encoder_hidden_states, return_dict=False)[0]


@dataclass
class StandInConfig:
    patch_size: tuple[int, int, int] = (1, 2, 2)
    in_channels: int = LATENT_CHANNELS
    out_channels: int = LATENT_CHANNELS
    text_dim: int = TEXT_DIM
    image_dim: int | None = None


def save_tokenizer(folder: Path) -> None:
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {word: i for i, word in enumerate(["<pad>", "<unk>", *WORDS])}
    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    PreTrainedTokenizerFast(tokenizer_object=tokenizer, unk_token="<unk>", pad_token="<pad>").save_pretrained(folder)


def build_latent_split(root: Path, seed: int = 0) -> Path:
    """``root/latents/train`` with a manifest naming a tiny VAE (``root/vae``) and text encoder
    (``root/text_encoder``) by paths relative to it; returns the split folder."""
    from diffusers import AutoencoderKL
    from transformers import UMT5Config, UMT5EncoderModel

    torch.manual_seed(seed)
    AutoencoderKL(down_block_types=("DownEncoderBlock2D",) * 3, up_block_types=("UpDecoderBlock2D",) * 3,
                  block_out_channels=(8, 8, 8), layers_per_block=1, latent_channels=LATENT_CHANNELS,
                  norm_num_groups=4, scaling_factor=1.5, shift_factor=0.1).save_pretrained(root / "vae")
    UMT5EncoderModel(UMT5Config(vocab_size=len(WORDS) + 2, d_model=TEXT_DIM, d_kv=8, d_ff=64, num_layers=1,
                                num_heads=2, relative_attention_num_buckets=8)).save_pretrained(root / "text_encoder")
    save_tokenizer(root / "text_encoder")
    split = root / "latents" / "train"
    split.mkdir(parents=True)
    manifest = {"format_version": 1, "latent_channels": LATENT_CHANNELS, "text_dim": TEXT_DIM,
                "vae": {"path": "../../vae", "class": "AutoencoderKL", "scaling_factor": 1.5, "shift_factor": 0.1,
                        "spatial_factor": 4, "temporal_factor": 1},
                "text_encoder": {"path": "../../text_encoder", "max_length": 16}}
    (split / "manifest.json").write_text(json.dumps(manifest))
    return split
