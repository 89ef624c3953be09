"""Video diffusion transformer (Wan 2.1 text-to-video architecture) over packed rows of latent
patches, weight-compatible with diffusers' ``WanTransformer3DModel``. Registered as "dit": trains
with rectified flow (or DDPM) on the ``video_latents`` dataset kind."""

from veomni.spec import ModelSpec, register_model
from veomni.tasks import DiffusionTask

from . import hf_adapter
from .config import DiTConfig
from .cost import DiTCost
from .model import DiTModel


def diffusion_task(config: DiTConfig) -> DiffusionTask:
    return DiffusionTask(objective=config.objective, logit_mean=config.logit_mean, logit_std=config.logit_std,
                         shift=config.shift, shift_base_tokens=config.shift_base_tokens,
                         text_dropout=config.text_dropout)


register_model(ModelSpec(
    name="dit",
    config_cls=DiTConfig,
    build=DiTModel,
    task=diffusion_task,
    dataset="video_latents",
    cost=DiTCost(),
    hf_adapter=hf_adapter,
))

__all__ = ["DiTConfig", "DiTModel"]
