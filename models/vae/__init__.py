"""A small diffusers ``AutoencoderKL`` trained with the engine (stage 0 of the text-to-video recipe,
which cannot download a VAE). Registered as "vae": trains with the reconstruction task on random
frames of the raw clips (the ``frames`` dataset kind); ``data/build_vae.py`` writes the trained
checkpoint as a diffusers folder (``diffusers_io``)."""

from veomni.contract import ModelSpec, register_model
from veomni.tasks import ReconstructionTask

from .config import VAEConfig
from .cost import VAECost
from .hf_adapter import VAEAdapter
from .model import VAEModel

register_model(ModelSpec(
    name="vae",
    config_cls=VAEConfig,
    build=VAEModel,
    task=lambda config: ReconstructionTask(config.latent_channels, config.spatial_factor, config.kl_weight,
                                           config.reconstruction),
    dataset="frames",
    cost=VAECost(),
    hf_adapter=VAEAdapter(),
))

__all__ = ["VAEConfig", "VAEModel"]
