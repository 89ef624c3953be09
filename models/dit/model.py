"""The video diffusion transformer (Wan 2.1's architecture) over packed rows of latent patches.

Plain single-device PyTorch; weight-compatible with diffusers' ``WanTransformer3DModel`` (module
names follow it; ``hf_adapter`` reshapes the two tensors whose layout differs). Where Wan runs a
padded batch, this model runs one row of patch tokens of several images and clips of any sizes
(NaViT-style packing, ``veomni.tasks.flow`` contract): timestep and modulation are computed per
sample and gathered per token, attention stays inside each sample, and each token cross-attends
to its own sample's caption. So a packed sample computes exactly what it would alone, and no
FLOP is spent on padding.
"""

from __future__ import annotations

import torch
from torch import nn

from veomni.contract.plan import ParallelPlan
from veomni.ops.attention import SeqInfo
from veomni.ops.rope import rope_3d_cos_sin

from .batch import pack_latents, unpack_tokens
from .config import DiTConfig
from .layers import ConditionEmbedder, DiTBlock, layer_norm_fp32
from .modulation import modulate


class DiTModel(nn.Module):
    """``model(noisy [T, P], batch) -> prediction [T, P]`` (velocity for flow, noise for DDPM)."""

    def __init__(self, config: DiTConfig) -> None:
        super().__init__()
        config.validate()
        self.config = config
        dim = config.hidden_size
        self.patch_embedding = nn.Linear(config.patch_dim, dim)
        self.condition_embedder = ConditionEmbedder(config)
        self.blocks = nn.ModuleList(DiTBlock(config) for _ in range(config.num_layers))
        self.proj_out = nn.Linear(dim, config.out_patch_dim)
        self.scale_shift_table = nn.Parameter(torch.empty(1, 2, dim))

    def forward(self, noisy: torch.Tensor, batch: dict) -> torch.Tensor:
        index = batch["sample_index"]
        timesteps, table_index = self._timestep_tables(batch)
        temb, modulation = self.condition_embedder.time(timesteps)
        text = self.condition_embedder.text_embedder(batch["text_states"])
        image, image_cu_seqlens = self._image_states(batch)
        cos, sin = rope_3d_cos_sin(batch["positions"], self.config.attention_head_dim)
        seq = SeqInfo(batch["cu_seqlens"], batch["max_seqlen"])
        x = self.patch_embedding(self._model_input(noisy))
        for block in self.blocks:
            x = block(x, modulation, index, text, batch["text_cu_seqlens"], cos, sin, seq, image, image_cu_seqlens,
                      table_index)
        shift, scale = (self.scale_shift_table + temb[:, None]).unbind(1)
        h = modulate(layer_norm_fp32(x, eps=self.config.eps), scale, shift, table_index).to(x.dtype)
        return self.proj_out(h) * (index >= 0)[:, None].to(x.dtype)

    def _timestep_tables(self, batch: dict) -> tuple[torch.Tensor, torch.Tensor]:
        """The timesteps the modulation tables are computed for, and each token's row in them: its
        sample's, or, with first-frame conditioning (``first_frame_probability`` > 0), a second row
        per sample at timestep 0 for its ``clean`` tokens (Wan2.2 TI2V's per-token timesteps, the
        first frame's tokens at 0), so a row still computes n + n timestep embeddings, not T."""
        sample = batch["sample_index"].clamp(min=0)
        if self.config.first_frame_probability <= 0 or "clean" not in batch:
            return batch["timesteps"], sample
        timesteps = batch["timesteps"]
        return torch.cat([timesteps, torch.zeros_like(timesteps)]), sample + len(timesteps) * batch["clean"].long()

    def _model_input(self, noisy: torch.Tensor) -> torch.Tensor:
        if noisy.shape[-1] != self.config.patch_dim:
            raise ValueError(f"the model takes {self.config.patch_dim} values per token (in_channels="
                             f"{self.config.in_channels} x patch {list(self.config.patch_size)}), the row gives "
                             f"{noisy.shape[-1]}: an image-to-video row appends its 'condition' tokens (the frame "
                             "mask and the first frame's latent) to the noisy ones, a text-to-video row none")
        return noisy

    def _image_states(self, batch: dict) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """Every sample's image states projected to the model width, and their boundaries."""
        embedder = self.condition_embedder.image_embedder
        if embedder is None:
            return None, None
        if "image_states" not in batch:
            raise ValueError(f"image_dim={self.config.image_dim}: the model cross-attends to image encoder states, "
                             "but the row has no 'image_states' / 'image_cu_seqlens' (a text-to-video sample "
                             "gives zero image states)")
        return embedder(batch["image_states"]), batch["image_cu_seqlens"]

    def forward_video(self, latents: torch.Tensor, timestep: torch.Tensor, encoder_hidden_states: torch.Tensor,
                      encoder_hidden_states_image: torch.Tensor | None = None,
                      clean_first_frame: bool = False) -> torch.Tensor:
        """diffusers' calling convention: latents [B, C, F, H, W] (image-to-video: the noisy latent
        and the condition concatenated on channels, as ``WanImageToVideoPipeline`` passes them),
        timestep [B], text states [B, L, text_dim], image states [B, L_img, image_dim] ->
        prediction [B, C_out, F, H, W]. ``clean_first_frame``: latent frame 0 holds a clean first
        frame (first-frame conditioning; its tokens take timestep 0, as ``clean`` rows in training)."""
        patch = self.config.patch_size
        images = None if encoder_hidden_states_image is None else list(encoder_hidden_states_image)
        batch = pack_latents(list(latents), list(encoder_hidden_states), timestep, patch, images)
        if clean_first_frame:
            if self.config.first_frame_probability <= 0:
                raise ValueError("sampling from a first frame needs a model trained with first-frame conditioning "
                                 "(model.first_frame_probability > 0); this one was trained without it")
            batch["clean"] = batch["positions"][:, 0] == 0
        return torch.stack(unpack_tokens(self(batch["latents"], batch), batch, patch))

    def parallel_plan(self) -> ParallelPlan:
        return ParallelPlan(blocks=("blocks.*",), attention=("blocks.*.attn1",))

    @torch.no_grad()
    def init_weights(self) -> None:
        """From the global RNG: linears normal(0, ``init_std``) with zero biases, the modulation
        tables normal(0, 1/sqrt(D)) as Wan's, norms reset, and ``proj_out`` zero, so the untrained
        model predicts zero (the usual DiT start; gradients reach every weight from step two)."""
        std = self.config.init_std
        for module in self.modules():
            if isinstance(module, nn.Linear):
                nn.init.normal_(module.weight, 0.0, std)
                nn.init.zeros_(module.bias)
            elif isinstance(module, (nn.LayerNorm, nn.RMSNorm)):
                module.reset_parameters()
        for name, param in self.named_parameters():
            if name.endswith("scale_shift_table"):
                nn.init.normal_(param, 0.0, param.shape[-1] ** -0.5)
        nn.init.zeros_(self.proj_out.weight)
