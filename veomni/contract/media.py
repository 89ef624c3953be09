"""The contract between the engine's chat-with-media dataset and a family's modalities.

A family whose model takes media (the zoo's omni models) describes each modality by a
``MediaKind``: how one item is processed from its shard bytes, the marker that stands for it
in chat text, and the webdataset member suffixes holding it; a ``MediaForm`` in the model's
``MediaLayout`` adds another kind of item one of those encoders takes (Qwen-VL's videos through its
image tower). The dataset (``veomni/data/chat/media_dataset.py``) reads these from the model config
(``MediaModelConfig``) and never imports the family.

A model that runs the encoders derives from ``MediaHost``: its forward hands each modality's
micro-batch inputs to the ``media_fn`` injection point (single-device default:
``run_media_locally``). Parallel recipes replace it (``veomni/parallel/media/colocate.py`` balances
encoder work across ranks and routes the features to the ranks holding a row's sequence
slices); they take items apart and price them with a kind's ``split`` and ``flops``, so they
too never import the family.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch
from torch import nn


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
    meta: Mapping[str, float] = field(default_factory=dict)
    """What the family's positions need to know of it beyond its encoder inputs (a Qwen-VL video's
    ``second_per_grid_ts``), read by ``MediaLayout.position_ids``; never an encoder input."""


class BadMediaMember(ValueError):
    """A media member that reads but does not hold what its format says (a video without its fps,
    frames of the wrong shape): a bug in the data's producer that skipping would hide, so the chat
    loader stops the run naming the shard, the sample and the member. (A member whose bytes are
    damaged raises what its decoder raises, and is skipped and counted.)"""


class MediaKind(Protocol):
    processor: Callable[[bytes, Any], MediaItem]
    """(raw member bytes, the encoder's config) -> the item; raises on a corrupt item."""
    placeholder: str
    """The marker in chat text (``"<image>"``)."""
    fields: tuple[str, ...]
    """Webdataset member suffixes holding items (``("png", "jpg")``)."""
    split: Callable[[Mapping[str, torch.Tensor], Any], list[MediaItem]]
    """(a micro-batch's collated encoder inputs, the encoder's config) -> its items in order, the
    inverse of ``collate_items``; each item's ``num_tokens`` is the feature rows the encoder makes
    for it."""
    flops: Callable[[nn.Module, Mapping[str, torch.Tensor]], float]
    """(the encoder, collated inputs) -> forward + backward FLOPs of the encoder on them; on one
    item's inputs, that item's encoder cost."""


class ShardableEncoder:
    """Base of media encoders that can run on a contiguous share of one input's sequence rows
    (long-short sequence parallelism, ``veomni/parallel/media/encoder_sp.py``): the engine picks the
    share, the encoder computes positions and sample boundaries for the whole input, embeds and
    runs only the held rows, and returns only their features.

    Subclasses take ``share: RowShare | None = None`` in ``forward`` (None: the whole input),
    put it in the ``SeqInfo`` their attention modules receive, and return the feature rows of
    ``share.start:share.stop``, which must be multiples of ``rows_per_feature``. Rows are counted
    in the encoder's *share order* (``share_order``): input order unless the encoder reorders its
    sequence (Qwen2.5-VL's attention windows), where a contiguous share of input rows would not
    be a set of whole attention segments."""

    rows_per_feature: int
    """Sequence rows behind one output feature row (the ViT: its merge group, ``merge_size**2``);
    share boundaries fall on multiples of it, so chunks of features concatenate to the whole."""

    def sequence_rows(self, inputs: Mapping[str, torch.Tensor]) -> int:
        """Rows of the transformer sequence ``forward(**inputs)`` runs (what a long-item
        threshold is compared with and what shares split)."""
        raise NotImplementedError

    def share_order(self, inputs: Mapping[str, torch.Tensor]) -> torch.Tensor | None:
        """The order in which the encoder runs the features of ``inputs`` when it runs a share:
        LongTensor [features], the input index of each feature in that order (a permutation), or
        None for input order. Shares cut this order (``rows_per_feature`` rows per feature) and a
        share's features come back in it; the engine puts them back into input order, so a
        sequence-parallel run still returns what ``forward(**inputs)`` returns. The same on every
        rank for the same inputs (pure)."""
        return None


@dataclass(frozen=True)
class MediaForm:
    """Items of another kind that one of the model's modalities encodes (Qwen-VL: videos, which its
    image tower takes as items of several temporal patches). They have their own marker, shard
    members and processor, and their own pad token (``MediaLayout.pad[name]``), but no encoder of
    their own: a packed row carries them in the ``encoder`` modality's media entry, with its items,
    in text order, so the model, its parallel recipes and their cost models see one modality."""

    encoder: str
    """The modality (a ``media_kinds()`` name) whose encoder and media entry take the items."""
    processor: Callable[[bytes, Any], MediaItem]
    """(raw member bytes, the encoder's config) -> the item, as ``MediaKind.processor``."""
    placeholder: str
    """The marker in chat text (``"<video>"``)."""
    fields: tuple[str, ...]
    """Member suffixes holding items (``("video.npz",)``)."""


SamplePositions = Callable[[torch.Tensor, Mapping[str, list[MediaItem]]], torch.Tensor]
"""(one sample's token ids [n], its media items per modality, in order) -> its position ids."""


@dataclass(frozen=True)
class MediaLayout:
    """How a family writes its media into the token row (``MediaModelConfig.media_layout``).

    The default (``MediaLayout(pad={name: marker})``): each item becomes one placeholder token per
    feature row, the marker itself, and positions are 1-D, restarting per sample. A family whose
    model was trained with its own layout (Qwen-VL: ``<|vision_start|>``, ``<|image_pad|>`` per
    feature, ``<|vision_end|>``; (t, h, w) positions) states it here, so a sample costs, and the
    model sees, the tokens it was trained on.
    """

    pad: Mapping[str, str]
    """Modality name -> the token repeated once per feature row of an item."""
    start: str | None = None
    """Token written before every item (not a placeholder: the features go to the pad tokens)."""
    end: str | None = None
    """Token written after every item."""
    token_ids: Mapping[str, int] = field(default_factory=dict)
    """Tokens whose ids the model config fixes (Qwen-VL's ``image_token_id``...): added to the
    tokenizer in id order, and a tokenizer that gives one of them another id is refused."""
    position_ids: SamplePositions | None = None
    """(one sample's token ids [n], its items per modality in order) -> its positions (e.g. [n, 3]);
    None: 1-D positions restarting per sample."""
    forms: Mapping[str, MediaForm] = field(default_factory=dict)
    """Item kinds read beside ``media_kinds()`` (name -> ``MediaForm``); ``pad`` names their tokens."""

    def __post_init__(self) -> None:
        missing = sorted(name for name in self.forms if name not in self.pad)
        if missing:
            raise ValueError(f"MediaLayout: the forms {missing} have no pad token")

    def encoder_of(self, name: str) -> str:
        """The modality whose media entry carries items of kind ``name`` (a form's encoder, or itself)."""
        form = self.forms.get(name)
        return name if form is None else form.encoder

    def tokens(self) -> list[str]:
        """Every token the layout writes, in the order they are added to a tokenizer."""
        fixed = sorted(self.token_ids, key=self.token_ids.get)
        rest = [*self.pad.values(), self.start, self.end]
        return fixed + [t for t in dict.fromkeys(rest) if t is not None and t not in self.token_ids]


@dataclass(frozen=True)
class ChatMarkup:
    """How the chat loader writes turns around their contents (``MediaModelConfig.chat_markup``; the
    recipe picks it with ``data.chat_markup``). A turn is ``header`` (``{role}`` / ``{Role}``: the role,
    lower case / capitalised) + its content + ``turn_end``, except an assistant turn, which ends with
    ``answer_end`` (a loss target with the content) + ``after_answer``. The engine's plain template
    is ``ChatMarkup("{Role}: ", "\n")``; a family whose model was trained on its own (Qwen-VL's
    ``<|im_start|>user\n...<|im_end|>\n``) declares it, so fine-tuning sees the format it answers in.
    """

    header: str
    turn_end: str
    answer_end: str | None = None
    """None: the tokenizer's eos token."""
    after_answer: str = ""
    default_system: str | None = None
    """A system turn written first when a conversation has none (Qwen's template does that)."""
    token_ids: Mapping[str, int] = field(default_factory=dict)
    """Special tokens of the markup and the ids the model config fixes: added to the tokenizer
    after the ``MediaLayout``'s, in id order, and a tokenizer giving one another id is refused."""

    def tokens(self) -> list[str]:
        return sorted(self.token_ids, key=self.token_ids.get)


class MediaModelConfig(Protocol):
    """What the chat-with-media dataset reads from a model config."""

    vocab_size: int
    encoder_configs: Mapping[str, Any]

    def media_kinds(self) -> dict[str, MediaKind]:
        """Modality name -> its kind, in the order of their placeholder tokens in the tokenizer."""
        ...

    def media_layout(self) -> MediaLayout:
        """The tokens and positions of media in the row (``MediaLayout``)."""
        ...

    def chat_markup(self) -> ChatMarkup | None:
        """The family's own chat markup (``data.chat_markup: model``); None: it has none."""
        ...


def collate_items(items: list[MediaItem]) -> dict[str, torch.Tensor]:
    """The encoder inputs of a micro-batch: each key's tensors concatenated along dim 0."""
    return {key: torch.cat([item.inputs[key] for item in items]) for key in items[0].inputs}


MediaFn = Callable[[str, nn.Module, Mapping[str, Any] | None, Mapping[str, torch.Tensor]], torch.Tensor]
"""(modality name, its encoder, this micro-batch's media entry of the modality or None when the
row holds no item of it, the modality's dummy inputs) -> the features for the entry's
``positions``, in order. The entry is ``{"inputs": the collated encoder inputs of the row's
items, "positions": where their features go}``; when ranks split the row (sequence parallelism)
``positions`` are this rank's slice's, in local coordinates, and ``holders`` gives the row rank
holding each feature row of the row's items (``veomni.tasks.vlm.localize_media``). Every rank
calls it once per modality and micro-batch whether or not it holds items, so an implementation
may run collectives; with None the caller adds ``0 * features.sum()`` to its output, which ties
whatever the call ran into the backward pass."""


def run_media_locally(name: str, encoder: nn.Module, media: Mapping[str, Any] | None,
                      dummy_inputs: Mapping[str, torch.Tensor]) -> torch.Tensor:
    """The single-device ``MediaFn``: the encoder on this micro-batch's items, or on the dummy
    input when it holds none (so the encoder's FSDP collectives still run on this rank)."""
    return encoder(**(media["inputs"] if media is not None else dummy_inputs))


class MediaHost:
    """Base of models whose forward runs media encoders through ``self.media_fn`` (a ``MediaFn``,
    ``run_media_locally`` until a parallel recipe replaces it)."""

    media_fn: MediaFn

    def media_config(self) -> MediaModelConfig:
        """The modalities (their ``MediaKind``) and encoder configs the forward runs."""
        raise NotImplementedError

    def media_encoder(self, name: str) -> nn.Module:
        """The encoder module of modality ``name`` (pipelines run it outside the forward)."""
        raise NotImplementedError

    def media_dummy_inputs(self, name: str, device: torch.device) -> dict[str, torch.Tensor]:
        """The smallest valid encoder input of modality ``name``, run by a rank that holds no item
        so that it still joins the encoder's collectives."""
        raise NotImplementedError


def join_media(media: list[Mapping[str, Mapping[str, Any]] | None], offsets: list[int]) -> dict[str, dict]:
    """The media of packed rows joined into one row: each modality's inputs concatenated, its
    placeholder positions shifted by the row's ``offsets`` entry (where the row starts)."""
    out: dict[str, dict] = {}
    for name in dict.fromkeys(name for m in media if m for name in m):
        parts = [(m[name], offset) for m, offset in zip(media, offsets) if m and name in m]
        out[name] = {"inputs": {key: torch.cat([p["inputs"][key] for p, _ in parts]) for key in parts[0][0]["inputs"]},
                     "positions": torch.cat([p["positions"] + offset for p, offset in parts])}
    return out
