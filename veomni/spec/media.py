"""The contract between the engine's chat-with-media dataset and a family's modalities.

A family whose model takes media (the zoo's omni models) describes each modality by a
``MediaKind``: how one item is processed from its shard bytes, the marker that stands for it
in chat text, and the webdataset member suffixes holding it. The dataset
(``veomni/data/multimodal.py``) reads these from the model config (``MediaModelConfig``) and
never imports the family.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, Protocol

import torch


@dataclass(frozen=True)
class MediaItem:
    """One processed media item (an image, a clip)."""

    inputs: dict[str, torch.Tensor]
    """Encoder inputs of this item; a micro-batch concatenates every key along dim 0."""
    num_tokens: int
    """Features the encoder produces for it: the placeholder tokens the text gets in its place."""
    cost: int
    """Work it adds to a micro-batch, counted against ``data.tokens_per_micro_batch`` with the
    text tokens (for an image: its patches)."""


class MediaKind(Protocol):
    processor: Callable[[bytes, Any], MediaItem]
    """(raw member bytes, the encoder's config) -> the item; raises on a corrupt item."""
    placeholder: str
    """The marker in chat text (``"<image>"``)."""
    fields: tuple[str, ...]
    """Webdataset member suffixes holding items (``("png", "jpg")``)."""


class MediaModelConfig(Protocol):
    """What the chat-with-media dataset reads from a model config."""

    vocab_size: int
    encoder_configs: Mapping[str, Any]

    def media_kinds(self) -> dict[str, MediaKind]:
        """Modality name -> its kind, in the order of their placeholder tokens in the tokenizer."""
        ...


def collate_items(items: list[MediaItem]) -> dict[str, torch.Tensor]:
    """The encoder inputs of a micro-batch: each key's tensors concatenated along dim 0."""
    return {key: torch.cat([item.inputs[key] for item in items]) for key in items[0].inputs}
