"""Configuration of an omni model: an LLM, one encoder per modality, and what to freeze.

A recipe writes it as nested blocks, checked against each part's own config dataclass::

    model:
      arch: omni
      llm: {vocab_size: 8200, hidden_size: 128, ...}           # models/llm LLMConfig fields
      encoders:
        image: {hidden_size: 96, out_hidden_size: 128, ...}   # the modality's config fields
      freeze: [encoders.image]                                 # optional
"""

from __future__ import annotations

import dataclasses
import difflib
from dataclasses import dataclass, field
from typing import Any

from models.llm.config import LLMConfig
from veomni.contract.media import ChatMarkup, MediaLayout

from .modality_registry import Modality, get_modality, registered_modalities


def _build(cls: type, options: dict[str, Any], where: str) -> Any:
    names = [f.name for f in dataclasses.fields(cls)]
    for key in options:
        if key not in names:
            close = difflib.get_close_matches(key, names, n=1)
            hint = f"; did you mean {close[0]!r}?" if close else f"; valid keys: {', '.join(names)}"
            raise ValueError(f"unknown option {key!r} in {where}{hint}")
    config = cls(**options)
    config.validate()
    return config


@dataclass
class OmniConfig:
    """``llm``: LLMConfig options (dense or MoE); ``encoders``: modality name -> that modality's
    encoder config options; ``freeze``: components whose parameters get no gradient and no
    optimizer state: ``llm``, ``encoders.<name>`` (the encoder without its adapter) or
    ``adapters.<name>`` (the encoder's adapter into the LLM)."""

    llm: dict[str, Any] = field(default_factory=dict)
    encoders: dict[str, dict[str, Any]] = field(default_factory=dict)
    freeze: list[str] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.llm_config: LLMConfig | None = None
        self.encoder_configs: dict[str, Any] = {}

    @property
    def modalities(self) -> tuple[str, ...]:
        """Modality names in recipe order (the order of their placeholder tokens in the tokenizer)."""
        return tuple(self.encoders)

    def media_kinds(self) -> dict[str, Modality]:
        """Modality name -> its registry entry, in recipe order (what the engine's chat-with-media
        dataset reads: ``veomni.contract.media.MediaModelConfig``)."""
        return {name: get_modality(name) for name in self.encoders}

    def media_layout(self) -> MediaLayout:
        """Each item is its marker token once per feature; positions are 1-D (``MediaLayout``)."""
        return MediaLayout(pad={name: kind.placeholder for name, kind in self.media_kinds().items()})

    def chat_markup(self) -> ChatMarkup | None:
        """None: a model trained here from scratch has no chat format of its own but the engine's."""
        return None

    @property
    def vocab_size(self) -> int:
        return self.llm_config.vocab_size

    @property
    def num_experts(self) -> int:
        """The LLM's routed experts (expert parallelism splits those; encoders are dense)."""
        return self.llm_config.num_experts

    def components(self) -> tuple[str, ...]:
        return ("llm", *(f"{kind}.{name}" for name in self.encoders for kind in ("encoders", "adapters")))

    def validate(self) -> None:
        """Build the parts' configs (each validated) and check they fit together."""
        self.llm_config = _build(LLMConfig, self.llm, "model.llm")
        if not self.encoders:
            raise ValueError(
                f"model.encoders is empty; name at least one modality: {', '.join(registered_modalities())}"
            )
        self.encoder_configs = {}
        for name, options in self.encoders.items():
            modality = get_modality(name)
            config = _build(modality.config_cls, options or {}, f"model.encoders.{name}")
            width = getattr(config, "out_hidden_size", None)
            if width != self.llm_config.hidden_size:
                raise ValueError(
                    f"model.encoders.{name}.out_hidden_size ({width}) must equal the LLM's "
                    f"hidden_size ({self.llm_config.hidden_size}): its features replace token embeddings"
                )
            self.encoder_configs[name] = config
        valid = self.components()
        for item in self.freeze:
            if item not in valid:
                close = difflib.get_close_matches(item, valid, n=1)
                hint = f"; did you mean {close[0]!r}?" if close else ""
                raise ValueError(f"model.freeze: unknown component {item!r}{hint}; valid: {', '.join(valid)}")
        if set(self.freeze) >= set(valid):
            raise ValueError("model.freeze lists every component: nothing would train")
