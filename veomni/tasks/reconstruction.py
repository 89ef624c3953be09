"""Autoencoder training: reconstruct images through a latent bottleneck with a KL prior (a VAE).

**Batch** (``RECONSTRUCTION_CONTRACT``; the ``frames`` dataset kind builds it): ``images``
[B, 3, H, W] float in [-1, 1], every image of a micro-batch the same size. The row is the batch
dimension and its unit is an *image*: throughput is reported in ``images_per_s`` (a pixel unit
would mislabel ``row_length``, which counts rows, and images are what a micro-batch budget
counts). ``prepare`` adds ``posterior_noise`` [B, C, h, w] (standard normal, the latent's shape)
from the engine's generator, so the posterior sample is replayed exactly on resume and differs
across data-parallel ranks.

**Model interface.** ``model(batch["images"], batch)`` returns ``(reconstruction, kl)``:
``reconstruction`` [B, 3, H, W] and ``kl`` [B], each image's KL divergence of the posterior from
N(0, I) summed over its latent elements (diffusers' ``DiagonalGaussianDistribution.kl``). In
training mode the model decodes ``mean + std * posterior_noise``; in eval mode the posterior mean.

**Loss**: the reconstruction error summed over every pixel value (L1 or squared error) plus
``kl_weight`` times the summed KL. Its units are pixel values (B x 3 x H x W), so the trainer's
division by the global count gives the per-value mean on any layout and batch split; the KL
weight is thus per pixel value, as in the LDM recipes. ``metrics`` report the two terms in the
same units (``loss_recon + loss_kl = loss``), the KL per image, and the squared error
(``mse``; PSNR = 10 log10(4 / mse) for the [-1, 1] range).

**Baseline**: predicting every pixel as the eval images' mean colour, scored with the training
reconstruction loss. Pixels come from uint8 frames, so each channel takes 256 levels: the stats
are a per-channel histogram of levels, from which the mean and its L1 or squared error are exact.
"""

from __future__ import annotations

from typing import Literal

import torch
from torch import nn

from veomni.tasks.base import Baseline, BatchContract, LossOutput

RECONSTRUCTION_CONTRACT = BatchContract(unit="image", sequence_fields=("images", "posterior_noise"))

Reconstruction = Literal["l1", "l2"]
LEVELS = 256
"""uint8 levels a pixel value in [-1, 1] was made from: ``level / 127.5 - 1``."""


class ReconstructionTask:
    """VAE training on ``RECONSTRUCTION_CONTRACT`` batches (module docstring)."""

    contract = RECONSTRUCTION_CONTRACT

    def __init__(self, latent_channels: int, spatial_factor: int, kl_weight: float = 1e-6,
                 reconstruction: Reconstruction = "l1") -> None:
        if reconstruction not in ("l1", "l2"):
            raise ValueError(f"unknown reconstruction loss {reconstruction!r}; use 'l1' or 'l2'")
        if kl_weight < 0:
            raise ValueError(f"kl_weight={kl_weight} must be >= 0")
        self.latent_channels, self.spatial_factor = latent_channels, spatial_factor
        self.kl_weight, self.reconstruction = kl_weight, reconstruction

    def prepare(self, batch: dict, generator: torch.Generator | None = None, training: bool = True) -> dict:
        """Add ``posterior_noise`` of the latent's shape (none without a generator: tests, tools)."""
        if generator is None:
            return batch
        images = batch["images"]
        b, _, h, w = images.shape
        f = self.spatial_factor
        if h % f or w % f:
            raise ValueError(f"images of {h}x{w} do not divide by the VAE's spatial factor {f}; crop them to a "
                             "multiple of it")
        noise = torch.randn((b, self.latent_channels, h // f, w // f), generator=generator, dtype=torch.float32)
        return {**batch, "posterior_noise": noise.to(images)}

    def count_loss_units(self, batch: dict) -> int:
        return batch["images"].numel()

    def __call__(self, model: nn.Module, batch: dict) -> LossOutput:
        images = batch["images"]
        reconstruction, kl = model(images, batch)
        error = reconstruction.float() - images.float()
        recon = self._error_sum(error)
        kl_term = self.kl_weight * kl.float().sum()
        units = self.count_loss_units(batch)
        return LossOutput(recon + kl_term, units, metrics={
            "loss_recon": (recon.detach(), units),
            "loss_kl": (kl_term.detach(), units),
            "kl_per_image": (kl.detach().float().sum(), images.shape[0]),
            "mse": (error.detach().pow(2).sum(), units),
        })

    def _error_sum(self, error: torch.Tensor) -> torch.Tensor:
        return error.abs().sum() if self.reconstruction == "l1" else error.pow(2).sum()

    def output_loss(self, output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        return self._error_sum(output.float() - target.float())

    def output_metrics(self, output: torch.Tensor, target: torch.Tensor) -> dict[str, tuple[torch.Tensor, int]]:
        return {}

    def baseline_stats(self, batch: dict) -> torch.Tensor:
        """Per channel, the count of each uint8 level: [3 * 256]."""
        images = batch["images"]
        levels = ((images.detach().double() + 1) * 127.5).round().clamp(0, LEVELS - 1).long()
        channel = torch.arange(images.shape[1], device=images.device)[None, :, None, None]
        index = (channel * LEVELS + levels).flatten()
        return torch.bincount(index, minlength=images.shape[1] * LEVELS).double()

    def baseline_loss(self, stats: torch.Tensor) -> Baseline | None:
        counts = stats.double().view(-1, LEVELS)
        total = float(counts.sum())
        if total == 0:
            return None
        values = torch.arange(LEVELS, dtype=torch.float64, device=counts.device) / 127.5 - 1
        per_channel = counts.sum(1).clamp(min=1)
        mean = (counts * values).sum(1) / per_channel
        deviation = values[None, :] - mean[:, None]
        error = deviation.abs() if self.reconstruction == "l1" else deviation.pow(2)
        name = "absolute" if self.reconstruction == "l1" else "squared"
        return Baseline(
            loss=float((counts * error).sum()) / total, name="the mean colour alone",
            meaning=(f"the mean {name} error of predicting every pixel as the eval images' mean colour, whatever the "
                     "image; below it, the autoencoder carries the images' content through its latents"))
