"""Diffusion training on packed rows of latent patches: rectified flow, and DDPM for comparison.

**Batch** (``FLOW_CONTRACT``; the ``video_latents`` dataset kind builds it, ``veomni.ops.video_patch``
fixes the token layout). A row packs the patch tokens of several images and clips:

- along the row (sliced by sequence parallelism): ``latents`` [T, P] clean latent patches,
  ``positions`` [T, 3] each token's (f, h, w) patch-grid index (per sample, from 0),
  ``sample_index`` [T] the token's sample in the row (-1: padding); ``prepare`` adds ``noisy``
  (the model input) and ``target`` [T, P];
- whole-row fields: ``cu_seqlens`` / ``max_seqlen`` (sample boundaries), ``grid`` [n, 3] each
  sample's patch grid, ``text_states`` [S, text_dim] the text encoder's states of every sample's
  caption, one after another, with ``text_cu_seqlens`` [n+1] their boundaries; ``prepare`` adds
  ``timesteps`` [n] (the model's timestep input, 0..1000).

The model is called as ``model(batch["noisy"], batch)`` and returns its prediction [T, P].
A row may carry ``condition`` [T, Q] (a sequence field of the raw row: an image-to-video
model's conditioning channels, e.g. Wan2.1 I2V's frame mask and first-frame latent): ``prepare``
appends it to the noisy tokens, so ``noisy`` is [T, P + Q] (diffusers' channel concatenation,
token by token) while ``target`` stays [T, P].

**First-frame conditioning** (``first_frame_probability`` > 0, Wan2.2 TI2V style, as diffusers'
Wan pipeline with ``expand_timesteps``): each clip sample (more than one patch frame) is, with that
probability, conditioned on its first frame: the tokens of patch frame 0 get the clean latent
instead of the noisy one, ``clean`` [T] (a sequence field ``prepare`` always adds, all False
without conditioning) marks them, the model gives them timestep 0, and they leave the loss and
its unit count. Samples of one row draw independently, so T2V and I2V samples share rows.

**Rectified flow** (the convention of Wan, SD3 and diffusers' ``FlowMatchEulerDiscreteScheduler``):
``x_t = (1 - t) x_0 + t ε`` for t in [0, 1], data at t = 0 and pure noise at t = 1; the model
predicts the velocity ``dx_t/dt = ε - x_0`` and takes ``1000 t`` as its timestep. t is drawn per
sample from a logit-normal (``t = sigmoid(m + s z)``), then shifted toward noise for larger
samples, ``t' = a t / (1 + (a - 1) t)`` with ``a = shift · sqrt(tokens / shift_base_tokens)`` (SD3's
resolution-dependent shift: more tokens keep more signal at the same t, so they need more noise).
Sampling integrates ``dx/dt = v`` from t = 1 to 0 on the same shifted schedule (``sample_sigmas``).

**DDPM** (``objective="ddpm"``): a diffusers ``DDPMScheduler``'s ``alphas_cumprod``,
``x_t = sqrt(ā_k) x_0 + sqrt(1 - ā_k) ε`` at an integer step k drawn uniformly per sample; the model
predicts ε and takes k as its timestep.

The loss is the squared error summed over every latent element of the row's real tokens, over
the elements per token (P, the same for every token of a model); its units are the real tokens (less the clean ones),
so the trainer's division by their global count gives the mean over all latent elements of the
step on any layout and packing. Condition dropout (for classifier-free guidance) zeroes a
sample's text states with probability ``text_dropout``: zero states are the unconditional input
at sampling too. All noise, timesteps and dropout come from the engine's task generator, drawn
on the whole row before sequence parallelism slices it.
"""

from __future__ import annotations

from typing import Literal

import torch
from torch import nn

from veomni.tasks.base import Baseline, BatchContract, LossOutput

FLOW_CONTRACT = BatchContract(
    unit="latent_token",
    sequence_fields=("latents", "positions", "sample_index", "noisy", "target", "clean"),
    pad_values={"sample_index": -1},
)

Objective = Literal["flow", "ddpm"]


def resolution_shift(tokens: torch.Tensor, shift: float, shift_base_tokens: int) -> torch.Tensor:
    """Per-sample timestep shift ``shift · sqrt(tokens / shift_base_tokens)`` (``shift`` alone when the base is 0)."""
    tokens = tokens.double()
    if shift_base_tokens <= 0:
        return torch.full_like(tokens, shift)
    return shift * torch.sqrt(tokens / shift_base_tokens)


def shift_sigmas(sigmas: torch.Tensor, shift: torch.Tensor | float) -> torch.Tensor:
    """``a t / (1 + (a - 1) t)``: moves t toward 1 (noise) for a > 1; fixes 0 and 1."""
    return shift * sigmas / (1 + (shift - 1) * sigmas)


def sample_sigmas(steps: int, shift: float) -> torch.Tensor:
    """The ``steps + 1`` noise levels an Euler sampler walks, 1 -> 0, on the training shift."""
    return shift_sigmas(torch.linspace(1.0, 0.0, steps + 1, dtype=torch.float64), shift)


class DiffusionTask:
    """Rectified-flow (default) or DDPM training on ``FLOW_CONTRACT`` rows (module docstring)."""

    contract = FLOW_CONTRACT

    def __init__(self, objective: Objective = "flow", logit_mean: float = 0.0, logit_std: float = 1.0,
                 shift: float = 1.0, shift_base_tokens: int = 0, text_dropout: float = 0.1,
                 ddpm_steps: int = 1000, ddpm_beta_schedule: str = "squaredcos_cap_v2",
                 first_frame_probability: float = 0.0) -> None:
        if objective not in ("flow", "ddpm"):
            raise ValueError(f"unknown diffusion objective {objective!r}; use 'flow' or 'ddpm'")
        if not 0.0 <= text_dropout < 1.0:
            raise ValueError(f"text_dropout={text_dropout} must be in [0, 1)")
        if not 0.0 <= first_frame_probability <= 1.0:
            raise ValueError(f"first_frame_probability={first_frame_probability} must be in [0, 1]")
        self.first_frame_probability = first_frame_probability
        self.objective = objective
        self.logit_mean, self.logit_std = logit_mean, logit_std
        self.shift, self.shift_base_tokens = shift, shift_base_tokens
        self.text_dropout = text_dropout
        self.ddpm_steps = ddpm_steps
        self.alphas_cumprod: torch.Tensor | None = None
        if objective == "ddpm":
            from diffusers import DDPMScheduler

            scheduler = DDPMScheduler(num_train_timesteps=ddpm_steps, beta_schedule=ddpm_beta_schedule)
            self.alphas_cumprod = scheduler.alphas_cumprod.double()

    def prepare(self, batch: dict, generator: torch.Generator | None = None, training: bool = True) -> dict:
        x0 = batch["latents"]
        index = batch["sample_index"]
        real = index >= 0
        samples = len(batch["cu_seqlens"]) - 1
        noise = torch.randn(x0.shape, generator=generator, dtype=torch.float32).to(x0)
        if self.objective == "flow":
            tokens = torch.diff(batch["cu_seqlens"].cpu())
            z = torch.randn(samples, generator=generator, dtype=torch.float64)
            sigma = shift_sigmas(torch.sigmoid(self.logit_mean + self.logit_std * z),
                                 resolution_shift(tokens, self.shift, self.shift_base_tokens))
            signal, noise_scale, timesteps = 1 - sigma, sigma, 1000 * sigma
        else:
            steps = torch.randint(0, self.ddpm_steps, (samples,), generator=generator)
            alpha_bar = self.alphas_cumprod[steps]
            signal, noise_scale, timesteps = alpha_bar.sqrt(), (1 - alpha_bar).sqrt(), steps.double()
        drop = torch.rand(samples, generator=generator) < self.text_dropout
        per_token = index.clamp(min=0).cpu()
        a = signal.float()[per_token].to(x0.device)[:, None]
        b = noise_scale.float()[per_token].to(x0.device)[:, None]
        mask = real[:, None].to(x0.dtype)
        clean = self._clean_first_frames(batch, per_token, generator).to(x0.device)
        keep = (real & ~clean)[:, None].to(x0.dtype)
        out = dict(batch)
        condition = out.pop("condition", None)
        out["noisy"] = torch.where(clean[:, None], x0, a * x0 + b * noise) * mask
        if condition is not None:
            out["noisy"] = torch.cat([out["noisy"], condition.to(x0.dtype) * mask], dim=-1)
        out["target"] = ((noise - x0) if self.objective == "flow" else noise) * keep
        out["clean"] = clean
        out["timesteps"] = timesteps.float().to(x0.device)
        out["text_states"] = _drop_text(batch["text_states"], batch["text_cu_seqlens"], drop)
        return out

    def _clean_first_frames(self, batch: dict, per_token: torch.Tensor, generator: torch.Generator | None):
        """[T] bool: the tokens of patch frame 0 of the samples drawn for first-frame conditioning."""
        index = batch["sample_index"].cpu()
        if self.first_frame_probability <= 0:
            return torch.zeros(index.shape, dtype=torch.bool)
        clips = batch["grid"][:, 0].cpu() > 1
        chosen = (torch.rand(len(clips), generator=generator) < self.first_frame_probability) & clips
        return chosen[per_token] & (batch["positions"][:, 0].cpu() == 0) & (index >= 0)

    def _loss_tokens(self, batch: dict) -> torch.Tensor:
        return (batch["sample_index"] >= 0) & ~batch["clean"]

    def count_loss_units(self, batch: dict) -> int:
        return int(self._loss_tokens(batch).sum())

    def __call__(self, model: nn.Module, batch: dict) -> LossOutput:
        units = self.count_loss_units(batch)  # its host read waits for nothing yet: no forward queued
        prediction = model(batch["noisy"], batch)
        return LossOutput(self.output_loss(prediction * self._loss_tokens(batch)[:, None], batch["target"]), units)

    def output_loss(self, output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        """Summed over tokens of the per-token mean squared error (padding: zero output and target)."""
        return ((output.float() - target.float()) ** 2).sum() / target.shape[1]

    def output_metrics(self, output: torch.Tensor, target: torch.Tensor) -> dict[str, tuple[torch.Tensor, int]]:
        return {}

    def baseline_stats(self, batch: dict) -> torch.Tensor:
        target = batch["target"][self._loss_tokens(batch)].double()
        return torch.stack([torch.tensor(float(target.numel()), dtype=torch.float64, device=target.device),
                            target.sum(), (target**2).sum()])

    def baseline_loss(self, stats: torch.Tensor) -> Baseline | None:
        count, total, squares = (float(v) for v in stats)
        if count == 0:
            return None
        mean = total / count
        what = "velocity" if self.objective == "flow" else "noise"
        return Baseline(
            loss=squares / count - mean * mean, name=f"the mean {what} alone",
            meaning=(f"the squared error of predicting the eval targets' mean {what} for every latent element, "
                     "whatever the input (the targets' variance); below it, the model uses the noisy latents, "
                     "the timestep or the caption"))


def _drop_text(states: torch.Tensor, cu_seqlens: torch.Tensor, drop: torch.Tensor) -> torch.Tensor:
    """``states`` with the rows of every dropped sample's caption set to zero."""
    if not bool(drop.any()):
        return states
    bounds = cu_seqlens.cpu()
    lengths = torch.diff(bounds)
    keep = torch.repeat_interleave(~drop, lengths).to(states.device)
    return states * keep[:, None].to(states.dtype)


def euler_flow_step(x: torch.Tensor, velocity: torch.Tensor, sigma: float, sigma_next: float) -> torch.Tensor:
    """One Euler step of ``dx/dt = v`` from t = ``sigma`` to ``sigma_next``."""
    return x + (sigma_next - sigma) * velocity


def guided(conditional: torch.Tensor, unconditional: torch.Tensor, scale: float) -> torch.Tensor:
    """Classifier-free guidance: ``u + scale (c - u)``."""
    return unconditional + scale * (conditional - unconditional)

