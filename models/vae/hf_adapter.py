"""Name and config mapping between ``VAEModel`` and a diffusers ``AutoencoderKL`` folder.

The wrapper owns the diffusers module as ``vae``, so the weight names are diffusers' own behind
that prefix and the config fields are ``AutoencoderKL``'s (``VAEConfig.diffusers_config``).
``config_to_hf`` returns the diffusers ``config.json`` contents (``_class_name`` names the class).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from .config import VAEConfig

PREFIX = "vae."
CLASS_NAME = "AutoencoderKL"


class VAEAdapter:
    hf_model_types = (CLASS_NAME,)
    free_fields = ("sample_size", "scaling_factor", "shift_factor", "kl_weight", "reconstruction")

    def config_from_hf(self, hf_config: Mapping[str, Any]) -> VAEConfig:
        down, up = hf_config.get("down_block_types", ()), hf_config.get("up_block_types", ())
        channels = tuple(hf_config["block_out_channels"])
        if set(down) != {"DownEncoderBlock2D"} or set(up) != {"UpDecoderBlock2D"} or len(down) != len(channels):
            raise ValueError(f"the vae family reads AutoencoderKL folders with one DownEncoderBlock2D and one "
                             f"UpDecoderBlock2D per block_out_channels entry; got {down} / {up} for {channels}")
        for flag in ("use_quant_conv", "use_post_quant_conv"):
            if not hf_config.get(flag, True):
                raise ValueError(f"the vae family needs {flag}=true (its weights are part of the model)")
        fields = ("in_channels", "out_channels", "latent_channels", "layers_per_block", "norm_num_groups", "act_fn",
                  "mid_block_add_attention", "sample_size", "scaling_factor")
        options = {name: hf_config[name] for name in fields if name in hf_config}
        return VAEConfig(block_out_channels=channels, shift_factor=hf_config.get("shift_factor") or 0.0, **options)

    def config_to_hf(self, cfg: VAEConfig) -> dict[str, Any]:
        return {"_class_name": CLASS_NAME, **cfg.diffusers_config()}

    def state_dict_from_hf(self, hf_sd: Mapping[str, Any], cfg: VAEConfig) -> dict[str, Any]:
        return {PREFIX + name: tensor for name, tensor in hf_sd.items()}

    def loaded_name(self, name: str) -> str:
        """A folder's names are the loaded model's (``HFAdapter.loaded_name``)."""
        return name

    def state_dict_to_hf(self, sd: Mapping[str, Any], cfg: VAEConfig) -> dict[str, Any]:
        foreign = [name for name in sd if not name.startswith(PREFIX)]
        if foreign:
            raise ValueError(f"not a VAEModel state dict: {foreign[:3]} lack the {PREFIX!r} prefix")
        return {name[len(PREFIX):]: tensor for name, tensor in sd.items()}
