"""Build a run's data loader from the registered dataset kinds.

Importing this module registers the engine's own kinds (``packed_text``, ``chat_text``, ``chat_preference``,
``chat_prompts``, ``chat_media``, ``chat_media_preference``,
``chat_media_prompts``, ``graph``, ``frames``, ``video_latents``, ``video_clips``);
plugin packages register theirs when ``veomni.contract.load_plugins`` imports them.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from typing import Any

from veomni.config.schema import DataConfig
from veomni.data.chat import (  # noqa: F401  (register the kinds)
    media_dataset,
    media_preference,
    media_prompts,
    preference_dataset,
    prompt_dataset,
    text_dataset,
)
from veomni.data.graph import dataset as graph_dataset  # noqa: F401
from veomni.data.kinds import DatasetRequest, get_dataset_kind
from veomni.data.resume import ResumableLoader
from veomni.data.text import packed  # noqa: F401
from veomni.data.text.packed import load_tokenizer
from veomni.data.video import clips, frames, latents  # noqa: F401
from veomni.errors import BadConfig

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class RunData:
    """A run's data as one rank reads it: the dataset kind, its tokenizer (None for kinds without
    text) and the loader of either split, all from the same settings."""

    cfg: DataConfig
    kind: str
    tokenizer: Any
    dp_rank: int
    dp_size: int
    seed: int
    model_config: Any
    micro_batches: int

    def loader(self, split: str) -> ResumableLoader:
        return build_dataloader(self.cfg, split, self.tokenizer, self.dp_rank, self.dp_size, self.seed,
                                self.model_config, self.kind, self.micro_batches)


def run_data(cfg: DataConfig, spec_dataset: str, dp_rank: int, dp_size: int, seed: int, model_config: Any,
             micro_batches: int) -> RunData:
    """The run's ``RunData``: the recipe's kind (else the spec's) and the tokenizer it needs."""
    kind = dataset_kind_name(cfg, spec_dataset)
    return RunData(cfg, kind, load_run_tokenizer(cfg, kind), dp_rank, dp_size, seed, model_config, micro_batches)


def dataset_kind_name(cfg: DataConfig, spec_dataset: str) -> str:
    """The recipe's ``data.kind`` when set, else the model spec's."""
    return cfg.kind or spec_dataset


def load_run_tokenizer(cfg: DataConfig, kind: str) -> Any:
    """The tokenizer a kind needs (loaded from ``data.tokenizer``), or None for kinds without text."""
    return load_tokenizer(cfg.tokenizer) if get_dataset_kind(kind).needs_tokenizer else None


def build_dataloader(
    cfg: DataConfig,
    split: str,
    tokenizer: Any,
    dp_rank: int,
    dp_size: int,
    seed: int,
    model_config: Any = None,
    kind: str = "packed_text",
    micro_batches: int = 1,
) -> ResumableLoader:
    """Loader of micro-batch dicts for one data-parallel rank, from the dataset kind ``kind``.

    ``split="train"`` reads ``cfg.train_path`` and loops over epochs forever; ``"eval"`` reads
    ``cfg.eval_path`` once, in order (each new ``iter()`` starts over). Every rank must use the
    same ``seed`` and files so that all ranks agree on the sample order.
    """
    if split not in ("train", "eval"):
        raise ValueError(f"split must be 'train' or 'eval', got {split!r}")
    path = cfg.train_path if split == "train" else cfg.eval_path
    if split == "train" and cfg.sources:
        path = ", ".join(source.path for source in cfg.sources)
    if not path:
        raise BadConfig(f"data.{split}_path is not set")
    if not 0 <= dp_rank < dp_size:
        raise ValueError(f"dp_rank {dp_rank} outside dp_size {dp_size}")
    dataset = get_dataset_kind(kind).build(DatasetRequest(cfg, path, split, tokenizer, dp_rank, dp_size, seed,
                                                          model_config, micro_batches))
    if cfg.num_workers > 0:
        # Workers are forked; HF tokenizers would otherwise warn and turn its thread pool off in each one.
        os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    logger.info("%s data (%s): %s, rank %d/%d, %d worker(s)", split, kind, path, dp_rank, dp_size, cfg.num_workers)
    return ResumableLoader(dataset, batch_size=None, num_workers=cfg.num_workers)
