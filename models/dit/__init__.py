"""Video diffusion transformer (Wan 2.1 text-to-video architecture) over packed rows of latent
patches, weight-compatible with diffusers' ``WanTransformer3DModel``. Registered as "dit": trains
with rectified flow (or DDPM) on the ``video_latents`` dataset kind."""

from veomni.contract import ModelSpec, register_model

from . import hf_adapter
from .config import DiTConfig
from .cost import DiTCost
from .model import DiTModel
from .task import diffusion_task
from .validation import validation_writer

register_model(ModelSpec(
    name="dit",
    config_cls=DiTConfig,
    build=DiTModel,
    task=diffusion_task,
    dataset="video_latents",
    cost=DiTCost(),
    hf_adapter=hf_adapter,
    sample_writer=validation_writer,
))

__all__ = ["DiTConfig", "DiTModel"]
