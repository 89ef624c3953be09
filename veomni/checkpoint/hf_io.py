"""Import from, and export to, Hugging Face model folders (config.json + safetensors).

Generic over every registered model with an HF adapter: the adapter maps configs and
parameter names, this module does the file IO. Works offline on local folders only.
"""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file

from veomni.contract import get_model_spec, spec_for_hf_model_type
from veomni.contract.hf_folder import CONFIG_FILE, read_config_json, read_hf_config
from veomni.errors import BadConfig, MissingInput

TRANSFORMERS_WEIGHTS = "model"
DIFFUSERS_WEIGHTS = "diffusion_pytorch_model"
DEFAULT_MAX_SHARD_BYTES = 5 * 2**30
# Files of an HF model folder that are not tokenizer files (never copied from tokenizer_dir).
_MODEL_FILE_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".index.json")
_MODEL_FILE_NAMES = (CONFIG_FILE,)


def load_hf_pretrained(path: str | os.PathLike) -> tuple[str, Any, dict[str, torch.Tensor]]:
    """``(arch_name, config, state_dict)`` in our names from a local HF folder of a whole model.

    The architecture is found from ``config.json``'s ``model_type``; weights are read from
    ``model.safetensors`` or the shards listed in ``model.safetensors.index.json``.
    """
    folder = Path(path)
    spec = spec_for_hf_model_type(read_config_json(folder)[0])
    _, config = read_hf_config(folder)
    return spec.name, config, spec.hf_adapter.state_dict_from_hf(read_safetensors(folder), config)


def read_safetensors(folder: Path) -> dict[str, torch.Tensor]:
    """Every tensor of ``folder``'s safetensors files (the shards an index lists, else ``*.safetensors``)."""
    tensors: dict[str, torch.Tensor] = {}
    for shard in _weight_files(folder):
        tensors.update(load_file(shard))
    return tensors


def _weight_files(folder: Path) -> list[Path]:
    """The shards an index lists (``model.safetensors.index.json``, or diffusers'
    ``diffusion_pytorch_model.safetensors.index.json``), else every ``*.safetensors``."""
    indexes = sorted(folder.glob("*.safetensors.index.json"))
    if indexes:
        weight_map = json.loads(indexes[0].read_text())["weight_map"]
        return [folder / name for name in sorted(set(weight_map.values()))]
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise MissingInput(f"{folder} has no *.safetensors weights (pytorch_model.bin is not supported)")
    return files


def save_hf_pretrained(
    arch_name: str,
    config: Any,
    state_dict: Mapping[str, torch.Tensor],
    out_dir: str | os.PathLike,
    tokenizer_dir: str | os.PathLike | None = None,
    max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES,
) -> Path:
    """Write a folder that ``AutoModelForCausalLM`` / ``AutoTokenizer.from_pretrained`` load, or, for
    an adapter whose ``config_to_hf`` returns a plain dict (a diffusers ``config.json`` with
    ``_class_name``), one that the diffusers class's ``from_pretrained`` loads.

    ``state_dict`` holds full (unsharded) tensors in our names. Everything is written to a
    sibling temp folder first and renamed into place, so a crash never leaves a half export
    (an existing ``out_dir`` is replaced only once the new one is complete).
    """
    spec = get_model_spec(arch_name)
    if spec.hf_adapter is None:
        raise BadConfig(f"model {arch_name!r} has no Hugging Face adapter")
    out = Path(out_dir)
    hf_sd = _standalone_tensors(spec.hf_adapter.state_dict_to_hf(state_dict, config))
    hf_config = spec.hf_adapter.config_to_hf(config)
    diffusers_folder = isinstance(hf_config, Mapping)
    if not diffusers_folder:
        hf_config.dtype = next(iter(hf_sd.values())).dtype

    tmp = out.parent / f".{out.name}.tmp-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    try:
        if diffusers_folder:
            (tmp / CONFIG_FILE).write_text(json.dumps(dict(hf_config), indent=2) + "\n")
        else:
            hf_config.save_pretrained(tmp)
        _save_shards(hf_sd, tmp, max_shard_bytes, DIFFUSERS_WEIGHTS if diffusers_folder else TRANSFORMERS_WEIGHTS)
        if tokenizer_dir is not None:
            _copy_tokenizer(Path(tokenizer_dir), tmp)
        _publish(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out


def _standalone_tensors(sd: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Contiguous CPU tensors, none sharing storage (safetensors refuses shared storage)."""
    seen: set[int] = set()
    out = {}
    for name, tensor in sd.items():
        tensor = tensor.detach().to("cpu").contiguous()
        ptr = tensor.untyped_storage().data_ptr()
        if ptr in seen:
            tensor = tensor.clone()
        seen.add(ptr)
        out[name] = tensor
    return out


def _save_shards(sd: dict[str, torch.Tensor], folder: Path, max_shard_bytes: int, stem: str) -> None:
    """``{stem}.safetensors``, or numbered shards with ``{stem}.safetensors.index.json``."""
    shards: list[dict[str, torch.Tensor]] = [{}]
    size = 0
    for name, tensor in sd.items():
        nbytes = tensor.numel() * tensor.element_size()
        if shards[-1] and size + nbytes > max_shard_bytes:
            shards.append({})
            size = 0
        shards[-1][name] = tensor
        size += nbytes
    if len(shards) == 1:
        save_file(shards[0], folder / f"{stem}.safetensors", metadata={"format": "pt"})
        return
    weight_map = {}
    for i, shard in enumerate(shards, start=1):
        file_name = f"{stem}-{i:05d}-of-{len(shards):05d}.safetensors"
        save_file(shard, folder / file_name, metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(shard, file_name))
    total = sum(t.numel() * t.element_size() for t in sd.values())
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (folder / f"{stem}.safetensors.index.json").write_text(json.dumps(index, indent=2))


def _copy_tokenizer(src: Path, dst: Path) -> None:
    """Copy the tokenizer files of ``src`` (which may be a whole HF model folder)."""
    if not src.is_dir():
        raise MissingInput(f"tokenizer folder {src} does not exist")
    for file in src.iterdir():
        if (
            file.is_file()
            and file.name not in _MODEL_FILE_NAMES
            and not file.name.endswith(_MODEL_FILE_SUFFIXES)
        ):
            shutil.copy2(file, dst / file.name)


def _publish(tmp: Path, out: Path) -> None:
    """Rename ``tmp`` to ``out``, replacing an existing ``out`` only after ``tmp`` is complete."""
    if not out.exists():
        tmp.rename(out)
        return
    old = out.parent / f".{out.name}.old-{os.getpid()}"
    out.rename(old)
    tmp.rename(out)
    shutil.rmtree(old)
