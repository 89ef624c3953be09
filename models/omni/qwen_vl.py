"""Qwen2-VL and Qwen2.5-VL as an omni composition: the family ``qwen2_5_vl``.

A whole Qwen-VL model is the omni model with one encoder, ``encoders.image``, the ViT with the Qwen
tower's options (``models/vit``: 2-frame temporal patches; Qwen2.5-VL's RMSNorm, gated MLP and
windows), and an LLM with multimodal RoPE (``mrope_section``). Images and videos go through the
same tower: a video is an item whose ``grid_thw`` has t > 1 temporal patches, packed with the
images in row order under ``media["image"]``, so ``OmniModel`` runs it unchanged. What the family
adds to ``OmniConfig`` is what a Hugging Face folder states beyond its two halves (the placeholder
token ids, ``tokens_per_second`` of video time positions, which architecture it is), and the
(t, h, w) positions of a packed row (``position_ids``, from ``mrope_positions``), which the batch's
``position_ids`` must carry as [T, 3]. ``qwen_vl_adapter.py`` maps whole folders.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Mapping
from dataclasses import dataclass

import torch

from models.vit.processing import qwen_smart_resize
from veomni.contract.media import ChatMarkup, MediaForm, MediaItem, MediaLayout

from .config import OmniConfig
from .modalities import process_image
from .modality_registry import Modality, get_modality
from .mrope_positions import mrope_position_ids, token_types
from .qwen_video import FIELD, process_qwen_video

VARIANTS = ("qwen2_vl", "qwen2_5_vl")
TOKENS = {"vision_start_token_id": "<|vision_start|>", "vision_end_token_id": "<|vision_end|>",
          "image_token_id": "<|image_pad|>", "video_token_id": "<|video_pad|>"}
"""Qwen's chat template's tokens, by the config field holding each one's id."""
CHAT_TOKENS = {"im_start_token_id": "<|im_start|>", "im_end_token_id": "<|im_end|>"}
"""The tokens of Qwen's chat markup (ChatML), by the config field holding each one's id."""


@dataclass
class QwenVLConfig(OmniConfig):
    """``OmniConfig`` (``llm``, ``encoders: {image: ...}``, ``freeze``) plus the folder-level fields.

    variant: the Hugging Face architecture it is and exports to: "qwen2_vl" (LayerNorm tower, no
      windows; video time positions are temporal patch indices) or "qwen2_5_vl".
    tokens_per_second: Qwen2.5-VL's video time scale: a temporal patch spanning ``s`` seconds moves
      the time position by ``tokens_per_second * s``. None for Qwen2-VL.
    video_*: Qwen's video processor rules for ``<video>`` items of the chat shards
      (``models/omni/qwen_video.py``): frames sampled at ``video_fps`` (between ``video_min_frames``
      and ``video_max_frames``, an even count), each resized within ``video_min_pixels`` /
      ``video_max_pixels`` (the published defaults: 128 and 768 merged tokens' worth per frame).
      Data options, not the folder's: ``checkpoint.init_from_hf`` does not compare them.
    im_start_token_id / im_end_token_id: the ids of Qwen's chat markup tokens (``chat_markup``),
      checked against the tokenizer when a recipe picks ``data.chat_markup: model``.
    """

    variant: str = "qwen2_5_vl"
    image_token_id: int = 151655
    video_token_id: int = 151656
    vision_start_token_id: int = 151652
    vision_end_token_id: int = 151653
    tokens_per_second: int | None = 2
    """2 in the published Qwen2.5-VL checkpoints (transformers' default is 4)."""
    video_fps: float = 2.0
    video_min_frames: int = 4
    video_max_frames: int = 768
    video_min_pixels: int = 128 * 28 * 28
    video_max_pixels: int = 768 * 28 * 28
    im_start_token_id: int = 151644
    im_end_token_id: int = 151645

    def validate(self) -> None:
        """The omni checks, then the Qwen-VL ones; ``llm`` and ``encoders.image`` are then written out
        in full (every option of their configs), so that a recipe stating only some options compares
        option by option with a folder's config (``checkpoint.init_from_hf``)."""
        super().validate()
        if self.variant not in VARIANTS:
            raise ValueError(f"model.variant must be one of {VARIANTS}, got {self.variant!r}")
        if set(self.encoders) != {"image"}:
            raise ValueError(f"model.encoders of a Qwen-VL model is one tower for images and videos, "
                             f"'image'; got {sorted(self.encoders)}")
        if self.llm_config.mrope_section is None:
            raise ValueError("model.llm.mrope_section is required: Qwen-VL's LLM uses multimodal RoPE "
                             "(e.g. [16, 24, 24] for head_dim 128)")
        vision = self.encoder_configs["image"]
        if vision.merge_mode != "concat":
            raise ValueError(f"model.encoders.image.merge_mode must be 'concat' (Qwen-VL's merger), "
                             f"got {vision.merge_mode!r}")
        qwen2_5 = (vision.norm, vision.mlp) == ("rmsnorm", "gated")
        if qwen2_5 != (self.variant == "qwen2_5_vl"):
            raise ValueError(f"model.variant {self.variant!r} does not fit model.encoders.image (norm="
                             f"{vision.norm!r}, mlp={vision.mlp!r}): Qwen2.5-VL's tower is rmsnorm + gated, "
                             "Qwen2-VL's layernorm + plain")
        if (self.tokens_per_second is None) == qwen2_5:
            raise ValueError(f"model.tokens_per_second must be set for qwen2_5_vl and None for qwen2_vl, got "
                             f"{self.tokens_per_second!r} for {self.variant!r}")
        ids = (self.image_token_id, self.video_token_id, self.vision_start_token_id, self.vision_end_token_id)
        if len(set(ids)) != 4 or not all(0 <= i < self.llm_config.vocab_size for i in ids):
            raise ValueError(f"model.image_token_id, video_token_id, vision_start_token_id and vision_end_token_id "
                             f"must be distinct ids below vocab_size {self.llm_config.vocab_size}, got {ids}")
        self._validate_video(vision)
        self.llm = dataclasses.asdict(self.llm_config)
        self.encoders = {"image": dataclasses.asdict(vision)}

    def _validate_video(self, vision) -> None:
        if not self.video_fps > 0:
            raise ValueError(f"model.video_fps must be positive, got {self.video_fps!r}")
        if not vision.temporal_patch_size <= self.video_min_frames <= self.video_max_frames:
            raise ValueError(f"model.video_min_frames ({self.video_min_frames}) must be at least the temporal patch "
                             f"({vision.temporal_patch_size} frames) and at most model.video_max_frames "
                             f"({self.video_max_frames})")
        if not vision.resize_factor**2 <= self.video_min_pixels <= self.video_max_pixels:
            raise ValueError(f"model.video_min_pixels ({self.video_min_pixels}) must be at least one merged token "
                             f"({vision.resize_factor**2} pixels) and at most model.video_max_pixels "
                             f"({self.video_max_pixels})")

    def media_kinds(self) -> dict[str, Modality]:
        """The image modality with Qwen's processor rules: ``qwen_smart_resize`` (transformers' sizing,
        factor patch x merge) and the still image repeated over the 2-frame temporal patch."""
        processor = functools.partial(process_image, resize=qwen_smart_resize)
        return {"image": dataclasses.replace(get_modality("image"), processor=processor)}

    def media_layout(self) -> MediaLayout:
        """Qwen's chat template's layout: an ``<image>`` marker becomes ``<|vision_start|>``, one
        ``<|image_pad|>`` per merged token, ``<|vision_end|>``, and a ``<video>`` marker the same with
        ``<|video_pad|>`` (a ``MediaForm``: ``video.npz`` members, ``qwen_video.py``, encoded by the
        image tower); the four tokens must have the config's ids in the tokenizer; positions are
        M-RoPE's (t, h, w) per sample (``sample_position_ids``)."""
        video = functools.partial(process_qwen_video, fps=self.video_fps, min_frames=self.video_min_frames,
                                  max_frames=self.video_max_frames, min_pixels=self.video_min_pixels,
                                  max_pixels=self.video_max_pixels)
        return MediaLayout(pad={"image": TOKENS["image_token_id"], "video": TOKENS["video_token_id"]},
                           start=TOKENS["vision_start_token_id"], end=TOKENS["vision_end_token_id"],
                           token_ids={token: getattr(self, name) for name, token in TOKENS.items()},
                           position_ids=self.sample_position_ids,
                           forms={"video": MediaForm("image", video, "<video>", (FIELD,))})

    def chat_markup(self) -> ChatMarkup:
        """Qwen's chat template (ChatML, as its ``chat_template.json`` writes string contents):
        ``<|im_start|>{role}\n{content}<|im_end|>\n`` per turn, the default system turn "You are a
        helpful assistant." when a conversation has none; an answer's targets end with ``<|im_end|>``."""
        return ChatMarkup(header="<|im_start|>{role}\n", turn_end="<|im_end|>\n", answer_end="<|im_end|>",
                          after_answer="\n", default_system="You are a helpful assistant.",
                          token_ids={token: getattr(self, name) for name, token in CHAT_TOKENS.items()})

    def sample_position_ids(self, input_ids: torch.Tensor, media: Mapping[str, list[MediaItem]]) -> torch.Tensor:
        """[n, 3] positions of one sample from its ids and its image and video items, in order."""
        images, videos = media.get("image", []), media.get("video", [])
        grids = [torch.cat([item.inputs["grid_thw"] for item in items]) if items else None
                 for items in (images, videos)]
        seconds = torch.tensor([item.meta["second_per_grid_ts"] for item in videos]) if videos else None
        return self.position_ids(input_ids, torch.tensor([0, len(input_ids)]), *grids, seconds)

    def position_ids(
        self,
        input_ids: torch.Tensor,
        cu_seqlens: torch.Tensor,
        image_grid_thw: torch.Tensor | None = None,
        video_grid_thw: torch.Tensor | None = None,
        second_per_grid_ts: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """The M-RoPE positions [T, 3] of a packed row (``mrope_positions.mrope_position_ids``)."""
        if self.llm_config is None:
            self.validate()
        types = token_types(input_ids, self.image_token_id, self.video_token_id)
        per_second = self.tokens_per_second if self.variant == "qwen2_5_vl" else None
        return mrope_position_ids(types, cu_seqlens, self.encoder_configs["image"].merge_size, image_grid_thw,
                                  video_grid_thw, second_per_grid_ts, per_second)
