"""Our ``vae`` weights as a diffusers ``AutoencoderKL`` folder.

Why not ``scripts/export_hf.sh``: the engine's export writes transformers folders
(``model.safetensors``); a diffusers folder needs diffusers' file names, so the family builds the
``AutoencoderKL`` and lets diffusers' ``save_pretrained`` write it. Reading a training checkpoint
(``veomni.checkpoint.export.load_checkpoint_weights``) is the caller's part, ``data/build_vae.py``:
models never import ``torch.distributed``.
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Mapping
from pathlib import Path

import torch

from .config import VAEConfig
from .hf_adapter import VAEAdapter


def build_diffusers_vae(state_dict: Mapping[str, torch.Tensor], config: VAEConfig):
    """An ``AutoencoderKL`` of ``config`` holding ``state_dict`` (our names, full tensors), in eval mode."""
    from diffusers import AutoencoderKL

    adapter = VAEAdapter()
    hf_config = {k: v for k, v in adapter.config_to_hf(config).items() if not k.startswith("_")}
    vae = AutoencoderKL(**hf_config)
    vae.load_state_dict(adapter.state_dict_to_hf(state_dict, config), strict=True)
    return vae.eval()


def save_atomically(vae, out: Path) -> Path:
    """``vae.save_pretrained`` into a hidden sibling of ``out``, then renamed into place (an old
    ``out`` is replaced only once the new folder is complete), so no reader sees a half folder."""
    tmp = out.parent / f".{out.name}.tmp-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.parent.mkdir(parents=True, exist_ok=True)
    try:
        vae.save_pretrained(tmp, safe_serialization=True)
        if out.exists():
            old = out.parent / f".{out.name}.old-{os.getpid()}"
            out.rename(old)
            tmp.rename(out)
            shutil.rmtree(old)
        else:
            tmp.rename(out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out
