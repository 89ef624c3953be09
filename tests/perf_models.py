"""Tiny models and one training micro-batch per family, shared by the CPU speed guards
(``test_host_sync.py``, ``test_block_compile.py``, ``test_block_costs.py``): the same rows the
guards count syncs, ops and saved bytes on."""

from __future__ import annotations

import torch

from models.dit import diffusion_task
from models.dit.batch import pack_latents
from models.dit.config import DiTConfig
from models.dit.model import DiTModel
from models.llm import DecoderLM
from veomni.data.packing import pack_samples
from veomni.spec import build_model
from veomni.tasks.lm import LanguageModelingTask

LLM_OPTIONS = {"vocab_size": 64, "hidden_size": 32, "intermediate_size": 48, "num_layers": 2, "num_heads": 4,
               "num_kv_heads": 2, "head_dim": 8, "tie_embeddings": False, "init_std": 0.1, "qk_norm": True}
MOE_OPTIONS = LLM_OPTIONS | {"num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 16,
                             "router_aux_loss_coef": 0.01}
DIT_CONFIG = DiTConfig(patch_size=(1, 2, 2), num_attention_heads=2, attention_head_dim=12, in_channels=4,
                       out_channels=4, text_dim=16, freq_dim=32, ffn_dim=48, num_layers=2)


def tiny_llm(options: dict = LLM_OPTIONS) -> DecoderLM:
    _, model = build_model("llm", options)
    model.init_weights(torch.Generator().manual_seed(0))
    return model


def llm_batch(lengths=(5, 11, 3, 8), vocab: int = 64) -> dict:
    gen = torch.Generator().manual_seed(1)
    return pack_samples([torch.randint(0, vocab, (n,), generator=gen).tolist() for n in lengths])


def llm_step(model: DecoderLM, batch: dict) -> None:
    """One micro-batch's forward and backward as the step runs it (the task's summed loss)."""
    LanguageModelingTask()(model, batch).loss_sum.backward()


def tiny_dit(cfg: DiTConfig = DIT_CONFIG) -> DiTModel:
    torch.manual_seed(0)
    model = DiTModel(cfg)
    with torch.no_grad():  # init_weights zeroes proj_out: randomise every weight so nothing is trivial
        for param in model.parameters():
            param.normal_(0.0, 0.1)
    return model


def dit_batch(cfg: DiTConfig = DIT_CONFIG, shapes=((1, 4, 6), (3, 6, 4)), text_lengths=(3, 5)) -> dict:
    """A prepared row (noise and timesteps drawn) of latents of ``shapes`` (F, H, W)."""
    gen = torch.Generator().manual_seed(1)
    latents = [torch.randn(cfg.in_channels, *shape, generator=gen) for shape in shapes]
    texts = [torch.randn(n, cfg.text_dim, generator=gen) for n in text_lengths]
    batch = pack_latents(latents, texts, torch.zeros(len(shapes)), cfg.patch_size)
    return diffusion_task(cfg).prepare(batch, torch.Generator().manual_seed(3))


def dit_step(model: DiTModel, batch: dict) -> None:
    diffusion_task(model.config)(model, batch).loss_sum.backward()
