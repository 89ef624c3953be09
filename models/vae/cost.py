"""Cost model of the ``vae`` family: convolution and attention FLOPs counted from module shapes.

A unit is one image (the reconstruction task's unit). FLOPs of one image of H x W are counted
exactly for its config by running an ``AutoencoderKL`` of that config on the meta device (shapes
only, no memory, no arithmetic) with hooks on every ``Conv2d`` (2 x output pixels x
``weight.numel()`` multiply-adds, groups included) and ``Linear`` (2 x rows x ``weight.numel()``),
plus the mid block's attention cores (``QK^T`` and ``AV``: 4 x tokens^2 x channels). Norms,
activations and biases are left out (a few percent). Training costs three times the forward.
The count depends on the config and the image size only, so it is cached per (config, H, W) and
a sharded model (whose parameters are FSDP shards) costs the same as a whole one.

Activation memory per image: the output of every conv, norm, activation and linear layer, the
tensors autograd keeps for backward; under ``full`` checkpointing only the blocks' inputs and
the largest block's internals are live at once (plus everything outside the blocks).
"""

from __future__ import annotations

import functools
from collections.abc import Mapping
from dataclasses import astuple
from typing import Any

import torch
from torch import nn

from veomni.contract.plan import match_modules, module_path_matches

from .config import VAEConfig
from .model import VAEModel

SAVED = (nn.Conv2d, nn.GroupNorm, nn.SiLU, nn.Linear)
"""Module types whose outputs count as kept activations."""
BLOCKS_IN_VAE = ("encoder.down_blocks.*", "decoder.up_blocks.*")
"""The plan's blocks (``VAEModel.parallel_plan``) inside the ``AutoencoderKL`` it owns as ``vae``."""


@functools.lru_cache(maxsize=32)
def _profile(config_key: tuple, height: int, width: int) -> tuple[float, dict[str, int], int]:
    """(forward FLOPs of one image, elements each saving module outputs, by module path, the
    elements of every block's input together)."""
    config = VAEConfig(*config_key)
    with torch.device("meta"):
        vae = VAEModel(config).vae
    flops = [0.0]
    saved: dict[str, int] = {}

    def count(name: str, module: nn.Module, inputs: tuple, output: torch.Tensor) -> None:
        if isinstance(module, nn.Conv2d):
            flops[0] += 2.0 * output.shape[-2] * output.shape[-1] * module.weight.numel()
        elif isinstance(module, nn.Linear):
            flops[0] += 2.0 * output[..., 0].numel() * module.weight.numel()
        saved[name] = saved.get(name, 0) + output.numel()

    block_inputs = [0]

    def count_input(module: nn.Module, inputs: tuple) -> None:
        block_inputs[0] += inputs[0].numel()

    hooks = [m.register_forward_hook(functools.partial(count, name)) for name, m in vae.named_modules()
             if isinstance(m, SAVED)]
    hooks += [m.register_forward_pre_hook(count_input) for _, m in match_modules(vae, BLOCKS_IN_VAE)]
    with torch.no_grad():
        vae(torch.empty(1, config.in_channels, height, width, device="meta"))
    for hook in hooks:
        hook.remove()
    factor = config.spatial_factor
    tokens, channels = (height // factor) * (width // factor), config.block_out_channels[-1]
    attention_cores = 2 if config.mid_block_add_attention else 0  # encoder and decoder mid blocks
    flops[0] += attention_cores * 4.0 * tokens * tokens * channels
    return flops[0], saved, block_inputs[0]


def image_flops(config: VAEConfig, height: int, width: int) -> float:
    """Forward FLOPs of one H x W image (module docstring)."""
    return _profile(astuple(config), height, width)[0]


class VAECost:
    """The engine's ``CostModel`` for ``VAEModel``; reads only ``model.config``."""

    def batch_flops(self, model: nn.Module, batch: Mapping[str, Any]) -> float:
        images = batch["images"]
        return 3 * images.shape[0] * image_flops(model.config, images.shape[-2], images.shape[-1])

    def sample_flops(self, model: nn.Module, units: int) -> float:
        size = model.config.sample_size
        return 3 * units * image_flops(model.config, size, size)

    def activation_bytes_per_unit(self, model: nn.Module, bytes_per_elem: int, checkpointing: str) -> float:
        config = model.config
        _, saved, block_inputs = _profile(astuple(config), config.sample_size, config.sample_size)
        if checkpointing in ("none", "selective"):
            return float(bytes_per_elem * sum(saved.values()))
        if checkpointing != "full":
            raise ValueError(f"checkpointing must be one of none, selective, full; got {checkpointing!r}")
        per_block: dict[str, int] = {}
        outside = 0
        for name, elements in saved.items():
            block = _block_of(name)
            if block is None:
                outside += elements
            else:
                per_block[block] = per_block.get(block, 0) + elements
        return float(bytes_per_elem * (outside + max(per_block.values(), default=0) + block_inputs))

    def activated_params(self, model: nn.Module) -> int:
        return sum(p.numel() for p in model.parameters())

    def report_lines(self, model: nn.Module, units: int) -> list[str]:
        c = model.config
        side = c.sample_size // c.spatial_factor
        return [f"VAE: {c.sample_size}x{c.sample_size} images -> {c.latent_channels}x{side}x{side} latents "
                f"(spatial factor {c.spatial_factor})"]


def _block_of(name: str) -> str | None:
    parts = name.split(".")
    for depth in range(1, len(parts) + 1):
        prefix = ".".join(parts[:depth])
        if any(module_path_matches(prefix, pattern) for pattern in BLOCKS_IN_VAE):
            return prefix
    return None
