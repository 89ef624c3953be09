"""Registry of modalities an omni model can take: encoder, its config, and its sample processor.

A modality is everything the engine needs to carry one kind of media from a shard to the LLM,
so adding one touches no engine code:

- ``config_cls`` / ``encoder_cls``: the encoder, built from the ``model.encoders.<name>`` block of
  a recipe. ``encoder(**inputs)`` maps the collated inputs of a micro-batch to one feature row
  of the LLM's width per placeholder token, in order.
- ``processor(raw_bytes, config)``: one media item from a shard member -> ``MediaItem`` (the
  engine's ``veomni.contract.media`` type: encoder
  inputs, the number of features the encoder will produce for it, and its packing cost).
- ``dummy_inputs(config, largest=False)``: the smallest valid input, run by a rank whose
  micro-batch holds no item of this modality so that every rank runs the same collectives (FSDP
  all-gathers); with ``largest=True`` the largest input one item can be (for ``--dry-run``).
- ``placeholder``: the marker in chat text (``"<image>"``); ``fields``: the webdataset member
  suffixes holding items (``("png", "jpg")``); ``adapter``: the encoder submodule that maps
  encoder features into the LLM's space (frozen or trained on its own, see ``freeze``).
- ``flops(encoder, inputs)``: forward+backward FLOPs of the encoder on collated inputs, for MFU
  and ``--dry-run``; on one item's inputs, the cost by which balanced encoder work
  (``parallel.encoder_balance``) spreads items over ranks.
- ``split(inputs, config)``: collated micro-batch inputs -> the ``MediaItem`` of each item, in
  order (the inverse of ``veomni.contract.media.collate_items``), so a parallel recipe can move items
  between ranks and knows how many feature rows each one comes back with.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from veomni.contract.media import MediaItem


@dataclass(frozen=True)
class Modality:
    name: str
    config_cls: type
    encoder_cls: type[nn.Module]
    processor: Callable[[bytes, Any], MediaItem]
    dummy_inputs: Callable[..., dict[str, torch.Tensor]]
    flops: Callable[[nn.Module, Mapping[str, torch.Tensor]], float]
    split: Callable[[Mapping[str, torch.Tensor], Any], list[MediaItem]]
    placeholder: str
    fields: tuple[str, ...]
    adapter: str = "adapter"


_MODALITIES: dict[str, Modality] = {}


def register_modality(modality: Modality) -> Modality:
    """Add ``modality``; a different entry under a taken name or placeholder is an error."""
    existing = _MODALITIES.get(modality.name)
    if existing is not None and existing != modality:
        raise ValueError(f"modality {modality.name!r} is already registered")
    for other in _MODALITIES.values():
        if other.name != modality.name and other.placeholder == modality.placeholder:
            raise ValueError(f"placeholder {modality.placeholder!r} is taken by modality {other.name!r}")
    _MODALITIES[modality.name] = modality
    return modality


def registered_modalities() -> tuple[str, ...]:
    return tuple(sorted(_MODALITIES))


def get_modality(name: str) -> Modality:
    try:
        return _MODALITIES[name]
    except KeyError:
        raise ValueError(
            f"unknown modality {name!r}; registered: {', '.join(registered_modalities())}"
        ) from None
