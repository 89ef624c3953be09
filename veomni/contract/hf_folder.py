"""Read a Hugging Face / diffusers folder's ``config.json`` into one of our configs (no weights).

The registered adapters (``families.hf_adapter_for_model_type``) do the mapping; this module finds
the folder's architecture and hands the config to the adapter. It sits in the contract, below both
the recipe loader (``veomni.config``, which fills a recipe's model section from
``checkpoint.init_from_hf``) and the checkpoint code (``veomni.checkpoint``: the launch-time
comparison and the weight import), so that both read a folder the same way.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from veomni.contract.families import HFAdapter, hf_adapter_for_model_type
from veomni.errors import BadCheckpoint, MissingInput

CONFIG_FILE = "config.json"


def read_config_json(folder: Path) -> tuple[str, dict[str, Any]]:
    """``(architecture, contents)`` of ``folder/config.json``: the architecture is its ``model_type``
    (transformers) or ``_class_name`` (diffusers). MissingInput / BadCheckpoint say what is missing."""
    config_file = folder / CONFIG_FILE
    if not config_file.is_file():
        raise MissingInput(f"{folder} has no {CONFIG_FILE}; is it a Hugging Face model folder?")
    contents = json.loads(config_file.read_text())
    architecture = contents.get("model_type") or contents.get("_class_name")
    if not architecture:
        raise BadCheckpoint(f"{config_file} has neither model_type (transformers) nor _class_name (diffusers): "
                            "which architecture it holds is unknown")
    return architecture, contents


def read_hf_config(folder: Path) -> tuple[HFAdapter, Any]:
    """``(adapter, our config)`` of a Hugging Face / diffusers folder from ``config.json`` alone (no
    weights read), by the adapter registered for its architecture. A transformers config is read
    through ``AutoConfig`` (which fills in the defaults ``save_pretrained`` leaves out), a diffusers
    one is handed to the adapter as its dict."""
    import transformers

    architecture, contents = read_config_json(folder)
    adapter = hf_adapter_for_model_type(architecture)
    if "model_type" in contents:
        contents = transformers.AutoConfig.from_pretrained(folder, local_files_only=True)
    return adapter, adapter.config_from_hf(contents)
