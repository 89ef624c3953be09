"""The ``vae`` family's model: a thin wrapper that owns a diffusers ``AutoencoderKL``.

Why a wrapper and not our own VAE: the latents feed a DiT that later stages (and users) load
with diffusers, so the exported folder must be exactly an ``AutoencoderKL``; owning one keeps
every weight name and every numeric detail diffusers' own. The wrapper adds what the engine
needs: the task's call signature (``veomni.tasks.reconstruction``: ``forward(images, batch) ->
(reconstruction, kl per image)``, the posterior sample drawn from the engine's noise), a
``ParallelPlan`` and ``init_weights``.
"""

from __future__ import annotations

import torch
from torch import nn

from veomni.contract.plan import ParallelPlan

from .config import VAEConfig

INITIALISED = (nn.Conv2d, nn.GroupNorm, nn.Linear)
"""Every module type of an ``AutoencoderKL`` that holds parameters."""


class VAEModel(nn.Module):
    def __init__(self, config: VAEConfig) -> None:
        super().__init__()
        from diffusers import AutoencoderKL  # 5 s to import: only runs that build a VAE pay for it

        self.config = config
        self.vae = AutoencoderKL(**config.diffusers_config())

    def forward(self, images: torch.Tensor, batch: dict) -> tuple[torch.Tensor, torch.Tensor]:
        """``(reconstruction [B, C, H, W], KL per image [B])``. Training decodes the posterior
        sample ``mean + std * batch["posterior_noise"]`` (the mean when the batch has no noise);
        eval decodes the mean, as diffusers' ``sample_posterior=False``."""
        posterior = self.vae.encode(images).latent_dist
        noise = batch.get("posterior_noise")
        z = posterior.mean + posterior.std * noise if self.training and noise is not None else posterior.mean
        return self.vae.decode(z).sample, posterior.kl()

    def parallel_plan(self) -> ParallelPlan:
        """The encoder's down blocks and the decoder's up blocks are the repeated blocks (FSDP
        units, checkpointing units); the mid blocks and convolutions stay with the root."""
        return ParallelPlan(blocks=("vae.encoder.down_blocks.*", "vae.decoder.up_blocks.*"))

    def init_weights(self) -> None:
        """PyTorch's default initialisation of every convolution, norm and linear layer (what
        diffusers builds with), drawn from the global RNG the engine seeds."""
        for module in self.modules():
            if isinstance(module, INITIALISED):
                module.reset_parameters()
