"""Omni model: modality encoders -> placeholder positions of the LLM's input embeddings.

The text of a sample holds one placeholder token per encoder output feature (the data pipeline
expands each ``<image>`` marker to as many tokens as the encoder will produce). The forward
embeds the tokens, runs each encoder on its micro-batch inputs and writes the features, in
order, over the embeddings at that modality's placeholder positions; the LLM runs on the result.

A micro-batch without any item of a modality still runs that encoder, on its tiny dummy input,
and adds ``0 * features.sum()``: the encoder's FSDP all-gathers and gradient reduce-scatters
then run on every rank (otherwise a rank without images would leave the others waiting), and
its gradient contribution is exactly zero.

Encoders run through the ``media_fn`` injection point (``veomni.contract.media.MediaFn``): by
default this rank's items on this rank; ``parallel.encoder_balance`` swaps in a version that
spreads the items of all data-parallel ranks evenly by encoder cost and brings the features
back, and under sequence parallelism one that splits a row's items between the ranks holding it
and hands each rank its slice's features. The splice into the embeddings stays here either way.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch
from torch import nn

from models.llm.model import DecoderLM
from models.llm.moe import MoEHost
from veomni.contract.media import MediaFn, MediaHost, run_media_locally
from veomni.contract.plan import ParallelPlan, prefixed

from .config import OmniConfig
from .modality_registry import get_modality


class OmniModel(MoEHost, MediaHost, nn.Module):
    """``llm`` (models/llm DecoderLM, dense or MoE) + ``encoders`` (ModuleDict keyed by modality).
    ``MoEHost`` finds the LLM's MoE layers for the engine's per-step MoE bookkeeping; ``MediaHost``
    declares the ``media_fn`` injection point the encoders run through."""

    def __init__(self, cfg: OmniConfig) -> None:
        super().__init__()
        if cfg.llm_config is None:
            cfg.validate()
        self.config = cfg
        self.llm = DecoderLM(cfg.llm_config)
        self.encoders = nn.ModuleDict(
            {name: get_modality(name).encoder_cls(config) for name, config in cfg.encoder_configs.items()}
        )
        for component in cfg.freeze:
            for param in self._component_params(component):
                param.requires_grad_(False)
        self.media_fn: MediaFn = run_media_locally

    def media_config(self) -> OmniConfig:
        return self.config

    def media_encoder(self, name: str) -> nn.Module:
        return self.encoders[name]

    def media_dummy_inputs(self, name: str, device: torch.device) -> dict[str, torch.Tensor]:
        dummy = get_modality(name).dummy_inputs(self.config.encoder_configs[name])
        return {k: v.to(device) for k, v in dummy.items()}

    def _component_params(self, component: str) -> list[nn.Parameter]:
        """Parameters of ``llm``, ``encoders.<name>`` (minus its adapter) or ``adapters.<name>``."""
        if component == "llm":
            return list(self.llm.parameters())
        kind, name = component.split(".", 1)
        encoder = self.encoders[name]
        adapter = {id(p) for p in encoder.get_submodule(get_modality(name).adapter).parameters()}
        return [p for p in encoder.parameters() if (id(p) in adapter) == (kind == "adapters")]

    def forward(
        self,
        input_ids: torch.Tensor,
        position_ids: torch.Tensor,
        cu_seqlens: torch.Tensor,
        max_seqlen: int,
        media: Mapping[str, Mapping[str, Any]] | None = None,
        valid_tokens: int | None = None,
    ) -> torch.Tensor:
        """Packed forward -> logits [T, vocab].

        ``media[name]`` = ``{"inputs": encoder kwargs for the micro-batch, "positions": LongTensor of
        the row positions its features go to, in order}``; a modality may be absent. Under sequence
        parallelism the row is this rank's slice and ``positions`` the placeholders in it (local,
        maybe none); the ``media_fn`` then returns exactly their features.
        Rows from ``valid_tokens`` on are padding (a pipeline's fixed-size rows): MoE layers do not
        route them.
        """
        if self.llm.config.mrope_section is not None and position_ids.ndim == 1 and media:
            raise ValueError("this model's LLM uses multimodal RoPE (llm.mrope_section): a row with media needs "
                             "position_ids [T, 3] (t, h, w) per token, e.g. QwenVLConfig.position_ids; [T] would "
                             "give its image tokens text positions")
        x = self.llm.embed_tokens(input_ids)
        for name, encoder in self.encoders.items():
            item = (media or {}).get(name)
            dummy = self.media_dummy_inputs(name, input_ids.device)
            features = self.media_fn(name, encoder, item, dummy)
            if item is None:
                x = x + 0 * features.sum().to(x.dtype)
                continue
            positions = item["positions"]
            if features.shape[0] != positions.numel():
                raise ValueError(
                    f"{name}: the encoder produced {features.shape[0]} features for "
                    f"{positions.numel()} placeholder tokens"
                )
            x = x.index_put((positions,), features.to(x.dtype))
        return self.llm.forward_embeddings(x, position_ids, cu_seqlens, max_seqlen, valid_tokens)

    def parallel_plan(self) -> ParallelPlan:
        """The LLM's plan under ``llm.`` plus one sub-plan per encoder (the engine flattens them)."""
        llm = prefixed(self.llm.parallel_plan(), "llm")
        return ParallelPlan(
            blocks=llm.blocks,
            experts=llm.experts,
            attention=llm.attention,
            stages=llm.stages,
            encoders={f"encoders.{name}": enc.parallel_plan() for name, enc in self.encoders.items()},
        )

    @torch.no_grad()
    def init_weights(self) -> None:
        self.llm.init_weights()
        for encoder in self.encoders.values():
            encoder.init_weights()

    # ----- sizes and FLOPs -------------------------------------------------------------------
    def encoder_params(self, name: str) -> int:
        return sum(p.numel() for p in self.encoders[name].parameters())

    def training_flops(self, seq_lens: Sequence[int]) -> float:
        """The LLM's FLOPs for these text rows (encoders: ``micro_batch_flops``, ``report_lines``)."""
        return self.llm.training_flops(seq_lens)

    def micro_batch_flops(self, batch: Mapping[str, Any]) -> float:
        """Forward+backward FLOPs of a micro-batch: the LLM on its rows plus each encoder on its inputs."""
        flops = self.training_flops(batch["cu_seqlens"].diff().tolist())
        for name, item in (batch.get("media") or {}).items():
            flops += get_modality(name).flops(self.encoders[name], item["inputs"])
        return flops

    def activation_bytes_per_token(self, bytes_per_elem: int, checkpointing: str) -> float:
        """The LLM's per-token estimate; encoder activations scale with patches, not text tokens."""
        return self.llm.activation_bytes_per_token(bytes_per_elem, checkpointing)

    def report_lines(self, seq_len: int) -> list[str]:
        """``--dry-run`` lines: each encoder's parameters and FLOPs on its largest input."""
        lines = [
            f"llm           {sum(p.numel() for p in self.llm.parameters()):,} parameters, "
            f"{self.llm.activated_params():,} activated"
        ]
        for name in self.encoders:
            modality, config = get_modality(name), self.config.encoder_configs[name]
            params = self.encoder_params(name)
            largest = modality.dummy_inputs(config, largest=True)
            gflops = modality.flops(self.encoders[name], largest) / 1e9
            lines.append(
                f"encoder {name:<6}{params:,} parameters ({params / 1e6:.1f} M); {gflops:,.1f} GFLOP "
                f"forward+backward per largest input ({_describe(largest)})"
            )
        frozen = ", ".join(self.config.freeze) or "none"
        lines.append(f"frozen        {frozen}")
        return lines


def _describe(inputs: Mapping[str, torch.Tensor]) -> str:
    return ", ".join(f"{k} {list(v.shape)}" for k, v in inputs.items())
