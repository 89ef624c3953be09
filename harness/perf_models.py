"""Tiny models and one training micro-batch per family, shared by the CPU speed guards
(``test_host_sync.py``, ``test_block_compile.py``, ``test_block_costs.py``): the same rows the
guards count syncs, ops and saved bytes on."""

from __future__ import annotations

import dataclasses
from collections import Counter
from collections.abc import Callable
from typing import NamedTuple

import torch
import torch.nn.functional as F
import transformers
from diffusers import WanTransformer3DModel

from models.dit import diffusion_task
from models.dit import hf_adapter as dit_hf_adapter
from models.dit.batch import pack_latents
from models.dit.config import ARCHITECTURE_FIELDS, DiTConfig
from models.dit.model import DiTModel
from models.llm import DecoderLM
from models.llm import hf_adapter as llm_hf_adapter
from veomni.contract import build_model
from veomni.data.packing import pack_samples
from veomni.ops.cost_probes import aten_ops, saved_bytes
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


class Pair(NamedTuple):
    """Our model and its reference with the same weights, each as ``forward() -> loss`` on the
    same tokens; ``weights``: both models' parameters (not activations)."""

    ours: Callable[[], torch.Tensor]
    reference: Callable[[], torch.Tensor]
    tokens: int
    weights: list[torch.Tensor]


def qwen3_pair(layers: int, hidden: int = 32, heads: int = 4, kv_heads: int = 2, head_dim: int = 8,
               intermediate: int = 48, vocab: int = 64, tokens: int = 24, dtype: torch.dtype = torch.float32) -> Pair:
    """Our DecoderLM against transformers' ``Qwen3ForCausalLM`` (sdpa) on one sample, summed
    cross-entropy in fp32 logits on both sides."""
    hf_config = transformers.Qwen3Config(vocab_size=vocab, hidden_size=hidden, intermediate_size=intermediate,
                                         num_hidden_layers=layers, num_attention_heads=heads,
                                         num_key_value_heads=kv_heads, head_dim=head_dim,
                                         max_position_embeddings=max(64, tokens), tie_word_embeddings=False)
    torch.manual_seed(0)
    reference = transformers.AutoModelForCausalLM.from_config(hf_config, attn_implementation="sdpa")
    cfg = llm_hf_adapter.config_from_hf(reference.config)
    _, ours = build_model("llm", vars(cfg))
    ours.load_state_dict(llm_hf_adapter.state_dict_from_hf(reference.state_dict(), cfg), strict=True)
    ours.to(dtype), reference.to(dtype)
    batch = llm_batch((tokens,), vocab)
    labels = batch["labels"]

    def reference_loss() -> torch.Tensor:
        logits = reference(batch["input_ids"][None]).logits[0]
        return F.cross_entropy(logits.float(), labels, ignore_index=-100, reduction="sum")

    return Pair(lambda: LanguageModelingTask()(ours, batch).loss_sum, reference_loss, tokens,
                [*ours.parameters(), *reference.parameters()])


def wan_pair(layers: int, cfg: DiTConfig = DIT_CONFIG, latent: tuple[int, int, int] = (2, 8, 8),
             text_tokens: int = 6, dtype: torch.dtype = torch.float32) -> Pair:
    """Our DiT against diffusers' ``WanTransformer3DModel`` on one latent [C, *latent] with
    ``text_tokens`` caption states; the loss is the summed square of the prediction."""
    cfg = dataclasses.replace(cfg, num_layers=layers)
    torch.manual_seed(0)
    reference = WanTransformer3DModel(**{key: getattr(cfg, key) for key in ARCHITECTURE_FIELDS})
    ours = DiTModel(cfg)
    ours.load_state_dict(dit_hf_adapter.state_dict_from_hf(reference.state_dict(), cfg), strict=True)
    ours.to(dtype), reference.to(dtype)
    gen = torch.Generator().manual_seed(1)
    latents = torch.randn(1, cfg.in_channels, *latent, generator=gen).to(dtype)
    text = torch.randn(1, text_tokens, cfg.text_dim, generator=gen).to(dtype)
    timestep = torch.tensor([500.0])
    batch = pack_latents(list(latents), list(text), timestep, cfg.patch_size)
    return Pair(lambda: ours(batch["latents"], batch).pow(2).sum(),
                lambda: reference(latents, timestep, text).sample.pow(2).sum(),
                batch["latents"].shape[0], [*ours.parameters(), *reference.parameters()])


class BlockCosts(NamedTuple):
    """One block's costs, ours and the reference's: the difference between a 2-block and a
    1-block model, so embeddings, heads and losses cancel."""

    saved_per_token: tuple[float, float]
    ops: tuple[Counter, Counter]


def block_costs(make_pair: Callable[[int], Pair]) -> BlockCosts:
    measured = []
    for layers in (1, 2):
        pair = make_pair(layers)
        per_model = []
        for forward in (pair.ours, pair.reference):
            saved = saved_bytes(forward, pair.weights)
            per_model.append((saved / pair.tokens, aten_ops(lambda f=forward: f().backward())))
        measured.append(per_model)
    one, two = measured
    return BlockCosts(tuple(two[i][0] - one[i][0] for i in range(2)),
                      tuple(two[i][1] - one[i][1] for i in range(2)))
