"""Text -> video sampling with a trained DiT: the text encoder, the sampler and the VAE decoder in one place.

Why here and not in the engine: sampling needs diffusers and transformers modules (the VAE, the
text encoder, a DDIM scheduler), which belong to the zoo side. The sampler keeps the training
conventions of ``veomni.tasks.flow`` exactly, so what the model learned is what it is asked:

- **flow**: Euler steps of ``dx/dt = v`` from t = 1 to 0 on ``sample_sigmas`` with the training
  shift at the sample's token count (``resolution_shift``); the model takes ``1000 t``.
- **ddpm**: a diffusers ``DDIMScheduler`` (eta 0, deterministic) whose betas are the task's own
  (recovered from its ``alphas_cumprod``); the model predicts ε and takes the integer step.
- classifier-free guidance: the unconditional input is zero text states of length 1, as in the
  task's condition dropout.

Every prompt is sampled with its caption's real tokens only (no padding, as in training):
prompts whose token counts agree run as one batch. The initial noise of prompt i is the i-th
draw of one generator seeded with ``seed``, so a seed fixes the result whatever the batching.
Latents are stored normalised, ``(z - shift) · scaling``; decoding undoes that.

**From a first frame** (``first_frames``; a model trained with ``first_frame_probability`` > 0,
Wan2.2 TI2V style): the frame's latent (the VAE's posterior mean of the frame alone, normalised:
latent frame 0 of a clip that starts with it, for a per-frame or a causal Wan VAE) replaces latent
frame 0 before every model call and after the last step, and the model reads those tokens as
``clean`` (timestep 0), as diffusers' ``WanPipeline`` with ``expand_timesteps`` does: the sampler
and its schedule are otherwise unchanged, and the unconditional (guidance) input keeps the frame.
A **conditioning-channel model** (Wan2.1 I2V, ``in_channels`` > ``out_channels``) instead reads the
frame's conditioning channels after the noisy latent and its image states in every call, both
guidance branches, as ``WanImageToVideoPipeline`` gives them (``models/dit/image_to_video.py``).
"""

from __future__ import annotations

import math
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import numpy as np
import torch
from torch import nn

from models.dit.image_to_video import ConditionInputs, FirstFrameConditioner
from models.dit.latent_manifest import read_latent_manifest, resolve_folder
from veomni.ops.video_patch import patch_grid
from veomni.tasks.flow import DiffusionTask, Objective, euler_flow_step, guided, resolution_shift, sample_sigmas


class VideoDenoiser(Protocol):
    """What the sampler needs of a video model."""

    def forward_video(self, latents: torch.Tensor, timestep: torch.Tensor,
                      encoder_hidden_states: torch.Tensor) -> torch.Tensor:
        """``latents`` [B, C, F, H, W], ``timestep`` [B], text [B, L, text_dim] -> prediction like ``latents``.
        Sampling from a first frame also passes ``clean_first_frame=True`` (Wan2.2 form) or, to a
        conditioning-channel model, latents with the condition channels after the noisy ones and
        ``encoder_hidden_states_image`` (Wan2.1 form; ``DiTModel.forward_video``)."""


@dataclass(frozen=True)
class LatentFormat:
    """How pixels map to the latents the model was trained on (the latent manifest's ``vae`` entry)."""

    channels: int
    scaling_factor: tuple[float, ...]
    """One value, or one per channel (a Wan VAE's ``1 / latents_std``)."""
    shift_factor: tuple[float, ...]
    spatial_factor: int
    temporal_factor: int

    def denormalise(self, latents: torch.Tensor) -> torch.Tensor:
        """``[B, C, ...]`` stored latents ``(z - shift) · scaling`` -> the VAE's ``z``."""
        view = (1, -1) + (1,) * (latents.dim() - 2)
        scaling = torch.tensor(self.scaling_factor, dtype=latents.dtype, device=latents.device).view(view)
        shift = torch.tensor(self.shift_factor, dtype=latents.dtype, device=latents.device).view(view)
        return latents / scaling + shift

    def normalise(self, z: torch.Tensor) -> torch.Tensor:
        """``[B, C, ...]`` the VAE's ``z`` -> stored latents ``(z - shift) · scaling`` (``denormalise`` undone)."""
        view = (1, -1) + (1,) * (z.dim() - 2)
        scaling = torch.tensor(self.scaling_factor, dtype=z.dtype, device=z.device).view(view)
        shift = torch.tensor(self.shift_factor, dtype=z.dtype, device=z.device).view(view)
        return (z - shift) * scaling

    def latent_shape(self, frames: int, height: int, width: int) -> tuple[int, int, int, int]:
        """``[C, F', H', W']`` of a clip of ``frames`` x ``height`` x ``width`` pixels."""
        s, t = self.spatial_factor, self.temporal_factor
        if height % s or width % s:
            raise ValueError(f"height x width = {height} x {width}: both must be multiples of the VAE's spatial "
                             f"factor {s}")
        if (frames - 1) % t:
            raise ValueError(f"frames = {frames}: the VAE compresses time by {t}, so frames must be 1 + a "
                             f"multiple of {t}")
        return self.channels, 1 + (frames - 1) // t, height // s, width // s


def _values(value: float | list[float] | None) -> tuple[float, ...]:
    if value is None:
        return (0.0,)
    return tuple(float(v) for v in value) if isinstance(value, list) else (float(value),)


def latent_format(manifest: dict[str, Any]) -> LatentFormat:
    vae = manifest["vae"]
    return LatentFormat(channels=int(manifest["latent_channels"]), scaling_factor=_values(vae["scaling_factor"]),
                        shift_factor=_values(vae.get("shift_factor")),
                        spatial_factor=int(vae["spatial_factor"]), temporal_factor=int(vae["temporal_factor"]))


def ddim_scheduler(task: DiffusionTask):
    """A deterministic DDIM scheduler on the task's own noise schedule (betas from its ``alphas_cumprod``).

    Steps are spaced as Stable Diffusion samples its epsilon-prediction models ("leading", offset 1:
    the first step is t = 967 of 1000 for 30 steps). "trailing" would start at t = 999, where the
    cosine schedule leaves alpha_bar ~ 1e-8, and DDIM's data estimate (x - sqrt(1 - a) eps) / sqrt(a)
    multiplies the epsilon error by ~1e4: measured on the tiny recipe's DDPM run, trailing gave
    noise-like clips (colour read right 22.5% vs 17.5% for shuffled captions), leading 35% vs 20%."""
    from diffusers import DDIMScheduler

    alpha_bar = task.alphas_cumprod.double()
    previous = torch.cat([alpha_bar.new_ones(1), alpha_bar[:-1]])
    betas = (1 - alpha_bar / previous).tolist()
    return DDIMScheduler(num_train_timesteps=task.ddpm_steps, trained_betas=betas, clip_sample=False,
                         set_alpha_to_one=True, prediction_type="epsilon", timestep_spacing="leading",
                         steps_offset=1)


class VideoPipeline:
    """A DiT with the VAE and the text encoder it was trained with (module docstring)."""

    def __init__(self, model: nn.Module, task: DiffusionTask, patch_size: tuple[int, int, int], latents: LatentFormat,
                 vae: nn.Module, text_encoder: nn.Module, tokenizer: Any, max_text_length: int,
                 device: torch.device | str = "cpu", conditioner: FirstFrameConditioner | None = None) -> None:
        self.model, self.task = model, task
        self.conditioner = conditioner
        """Set for a conditioning-channel model (Wan2.1 I2V): builds its inputs from first frames."""
        self.patch_size = tuple(patch_size)
        self.latents = latents
        self.vae, self.text_encoder, self.tokenizer = vae, text_encoder, tokenizer
        self.max_text_length = max_text_length
        self.device = torch.device(device)

    @classmethod
    def from_latent_manifest(cls, model: nn.Module, task: DiffusionTask, patch_size: tuple[int, int, int],
                             train_path: str | Path, device: torch.device | str = "cpu",
                             conditioner: FirstFrameConditioner | None = None) -> VideoPipeline:
        """Load the VAE and the text encoder named by the latent split at ``train_path``; ``conditioner``
        (``scripts/sample.py``) for a conditioning-channel model sampled from images."""
        import diffusers
        from transformers import AutoTokenizer, UMT5EncoderModel

        manifest, folder = read_latent_manifest(train_path)
        vae_class = getattr(diffusers, manifest["vae"]["class"])
        vae = vae_class.from_pretrained(resolve_folder(manifest["vae"]["path"], folder)).to(device).eval()
        text_folder = resolve_folder(manifest["text_encoder"]["path"], folder)
        encoder = UMT5EncoderModel.from_pretrained(text_folder).to(device).eval()
        tokenizer = AutoTokenizer.from_pretrained(text_folder)
        return cls(model, task, patch_size, latent_format(manifest), vae, encoder, tokenizer,
                   int(manifest["text_encoder"]["max_length"]), device, conditioner)

    @torch.no_grad()
    def encode_prompts(self, prompts: list[str]) -> list[torch.Tensor]:
        """Per prompt, the encoder's last hidden states of its real tokens, [L_i, text_dim] float32."""
        states = []
        for prompt in prompts:
            ids = self.tokenizer(prompt, return_tensors="pt")["input_ids"]
            if ids.shape[1] > self.max_text_length or self.tokenizer.unk_token_id in ids[0].tolist():
                raise ValueError(f"prompt {prompt!r} has words the text encoder's tokenizer does not know or over "
                                 f"{self.max_text_length} tokens: use the training captions' vocabulary")
            ids = ids.to(self.device)
            states.append(self.text_encoder(input_ids=ids).last_hidden_state[0].float())
        return states

    def flow_sigmas(self, latent_shape: tuple[int, int, int, int], steps: int) -> torch.Tensor:
        """The Euler sampler's noise levels for latents of ``latent_shape``: the training shift at its token count."""
        tokens = math.prod(patch_grid(latent_shape, self.patch_size))
        shift = resolution_shift(torch.tensor([tokens]), self.task.shift, self.task.shift_base_tokens)
        return sample_sigmas(steps, float(shift[0]))

    @torch.no_grad()
    def sample_latents(self, prompts: list[str], frames: int, height: int, width: int, steps: int = 30,
                       guidance: float = 4.0, seed: int = 0, objective: Objective | None = None,
                       first_frames: torch.Tensor | None = None,
                       conditions: ConditionInputs | None = None) -> torch.Tensor:
        """Normalised latents [B, C, F', H', W'] for ``prompts`` at ``frames`` x ``height`` x ``width`` pixels;
        ``first_frames`` [B, C, 1, H', W'] (normalised latents): latent frame 0 held to them (module docstring);
        ``conditions``: a conditioning-channel model's inputs, the same in every call (``image_to_video``)."""
        if not prompts:
            raise ValueError("no prompts to sample")
        if steps < 1:
            raise ValueError(f"steps = {steps}: the sampler needs at least one step")
        objective = objective or self.task.objective
        if objective == "ddpm" and self.task.alphas_cumprod is None:
            raise ValueError("objective 'ddpm' needs a task trained with objective 'ddpm' (its noise schedule)")
        shape = self.latents.latent_shape(frames, height, width)
        generator = torch.Generator().manual_seed(seed)
        noise = torch.randn((len(prompts), *shape), generator=generator, dtype=torch.float32)
        if first_frames is not None and tuple(first_frames.shape) != (len(prompts), shape[0], 1, *shape[2:]):
            raise ValueError(f"first frame latents of shape {list(first_frames.shape)}, the sampler needs "
                             f"{[len(prompts), shape[0], 1, *shape[2:]]} (one per prompt, at the clip's size)")
        if conditions is not None and (len(conditions.condition), *conditions.condition.shape[2:]) != (
                len(prompts), *shape[1:]):
            raise ValueError(f"conditioning channels of shape {list(conditions.condition.shape)}, the sampler needs "
                             f"{[len(prompts), 'Q', *shape[1:]]} (one per prompt, at the clip's latent size)")
        texts = self.encode_prompts(prompts)
        groups: dict[int, list[int]] = defaultdict(list)
        for i, text in enumerate(texts):
            groups[text.shape[0]].append(i)
        out = torch.empty_like(noise)
        for members in groups.values():
            x = noise[members].to(self.device)
            text = torch.stack([texts[i] for i in members])
            first = None if first_frames is None else first_frames[members].to(self.device, torch.float32)
            given = None if conditions is None else conditions.select(members, self.device)
            sampler = self._flow if objective == "flow" else self._ddim
            out[members] = _hold(sampler(x, text, steps, guidance, first, given), first).float().cpu()
        return out

    def _velocity(self, x: torch.Tensor, timestep: float | int, text: torch.Tensor, guidance: float,
                  first: torch.Tensor | None, given: ConditionInputs | None) -> torch.Tensor:
        t = torch.full((x.shape[0],), float(timestep), device=self.device)
        x = _hold(x, first)
        extra = {} if first is None else {"clean_first_frame": True}
        if given is not None:  # Wan2.1 I2V: [noisy | condition] and the image states, in both guidance branches
            x = torch.cat([x, given.condition], dim=1)
            extra = {} if given.image is None else {"encoder_hidden_states_image": given.image}
        conditional = self.model.forward_video(x, t, text, **extra).float()
        if guidance == 1.0:
            return conditional
        empty = torch.zeros(x.shape[0], 1, text.shape[-1], device=self.device, dtype=text.dtype)
        return guided(conditional, self.model.forward_video(x, t, empty, **extra).float(), guidance)

    def _flow(self, x: torch.Tensor, text: torch.Tensor, steps: int, guidance: float,
              first: torch.Tensor | None, given: ConditionInputs | None) -> torch.Tensor:
        sigmas = self.flow_sigmas(tuple(x.shape[1:]), steps).tolist()
        for sigma, sigma_next in zip(sigmas[:-1], sigmas[1:]):
            x = euler_flow_step(x, self._velocity(x, 1000 * sigma, text, guidance, first, given), sigma, sigma_next)
        return x

    def _ddim(self, x: torch.Tensor, text: torch.Tensor, steps: int, guidance: float,
              first: torch.Tensor | None, given: ConditionInputs | None) -> torch.Tensor:
        scheduler = ddim_scheduler(self.task)
        scheduler.set_timesteps(steps)
        for step in scheduler.timesteps:
            epsilon = self._velocity(x, int(step), text, guidance, first, given)
            x = scheduler.step(epsilon, step, x).prev_sample
        return x

    @torch.no_grad()
    def encode_frames(self, frames: np.ndarray) -> torch.Tensor:
        """uint8 images [B, H, W, 3] -> normalised latents [B, C, 1, H', W'] of each image alone (the VAE's
        posterior mean, as the latent precompute takes it)."""
        if frames.dtype != np.uint8 or frames.ndim != 4 or frames.shape[-1] != 3:
            raise ValueError(f"first frames must be uint8 [B, H, W, 3]; got {frames.dtype} {list(frames.shape)}")
        pixels = torch.from_numpy(frames).to(self.device).permute(0, 3, 1, 2).float() / 127.5 - 1
        if self.latents.temporal_factor == 1:  # an image VAE
            z = self.vae.encode(pixels).latent_dist.mean[:, :, None]
        else:  # Wan's causal VAE: a one-frame clip is latent frame 0 of any clip starting with it
            z = self.vae.encode(pixels[:, :, None]).latent_dist.mean
        return self.latents.normalise(z.float()).cpu()

    @torch.no_grad()
    def decode(self, latents: torch.Tensor) -> np.ndarray:
        """Normalised latents [B, C, F', H', W'] -> uint8 pixels [B, F, H, W, 3] (the VAE works in [-1, 1])."""
        z = self.latents.denormalise(latents.to(self.device))
        b, c, f, h, w = z.shape
        if self.latents.temporal_factor == 1:  # an image VAE: every frame on its own
            frames = self.vae.decode(z.permute(0, 2, 1, 3, 4).reshape(b * f, c, h, w)).sample
            video = frames.reshape(b, f, *frames.shape[1:])
        else:
            video = self.vae.decode(z).sample.permute(0, 2, 1, 3, 4)
        pixels = ((video.float().clamp(-1, 1) + 1) * 127.5).round().to(torch.uint8)
        return pixels.permute(0, 1, 3, 4, 2).cpu().numpy()

    def generate(self, prompts: list[str], frames: int, height: int, width: int, steps: int = 30,
                 guidance: float = 4.0, seed: int = 0, first_frames: np.ndarray | None = None,
                 conditions: ConditionInputs | None = None) -> np.ndarray:
        """uint8 clips [B, F, H, W, 3] for ``prompts``, from ``first_frames`` (uint8 [B, H, W, 3]) when given:
        a conditioning-channel model's ``conditions`` are built from them (or given, e.g. from a latent
        cache); another model holds its latent frame 0 to them. The model is put in eval mode and restored after."""
        if self.conditioner is not None and first_frames is None and conditions is None:
            raise ValueError("the model reads conditioning channels (Wan2.1 image-to-video, in_channels > "
                             "out_channels): give a first frame (scripts/sample.sh --image FRAME.png)")
        was_training = self.model.training
        self.model.eval()
        try:
            first = None
            if first_frames is not None and self.conditioner is not None:
                conditions = self.conditioner(first_frames, frames)
            elif first_frames is not None:
                first = self.encode_frames(first_frames)
            return self.decode(self.sample_latents(prompts, frames, height, width, steps, guidance, seed,
                                                   first_frames=first, conditions=conditions))
        finally:
            self.model.train(was_training)


def _hold(x: torch.Tensor, first: torch.Tensor | None) -> torch.Tensor:
    """``x`` [B, C, F, H, W] with latent frame 0 replaced by ``first`` [B, C, 1, H, W] (unchanged without)."""
    return x if first is None else torch.cat([first.to(x.dtype), x[:, :, 1:]], dim=2)
