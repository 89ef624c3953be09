"""The model-level parts of ``scripts/gpu_check.py``: ours against transformers and diffusers.

Each times whole training steps (forward, backward, fused AdamW on CUDA) of two models built from
one config with the same weights, in bf16 on a GPU (fp32 on a CPU), on the same inputs, and
reports the median step after the warm-up steps, tokens/s, MFU (our FLOPs formulas for both, so
the two are comparable) and peak memory. The DiT and MoE pairs are compared for equal outputs
in fp32 before any timing: a fast model that computes something else is no result.
"""

from __future__ import annotations

import dataclasses
import statistics
import time
from collections.abc import Callable

import torch

from models.dit import hf_adapter as dit_adapter
from models.dit.config import ARCHITECTURE_FIELDS, DiTConfig
from models.dit.cost import forward_flops
from models.dit.model import DiTModel
from models.llm import hf_adapter as llm_adapter
from veomni.contract import build_model, get_model_spec, load_plugins
from veomni.data.packing import pack_samples
from veomni.parallel.activation_checkpoint import apply_activation_checkpointing

QWEN3_1P7B = dict(family="qwen3", vocab_size=151936, hidden_size=2048, intermediate_size=6144, num_layers=28,
                  num_heads=16, num_kv_heads=8, head_dim=128, qk_norm=True, tie_embeddings=True,
                  rope_theta=1e6, rms_norm_eps=1e-6, max_position_embeddings=40960)
QWEN3_MOE_SMALL = dict(family="qwen3", vocab_size=151936, hidden_size=1024, intermediate_size=3072, num_layers=12,
                       num_heads=16, num_kv_heads=4, head_dim=64, qk_norm=True, tie_embeddings=False,
                       rope_theta=1e6, rms_norm_eps=1e-6, max_position_embeddings=40960, num_experts=64,
                       num_experts_per_tok=8, moe_intermediate_size=768)
WAN_1P3B = DiTConfig(patch_size=(1, 2, 2), num_attention_heads=12, attention_head_dim=128, in_channels=16,
                     out_channels=16, text_dim=4096, freq_dim=256, ffn_dim=8960, num_layers=30)
TINY_LLM = dict(vocab_size=512, hidden_size=64, intermediate_size=128, num_layers=2, num_heads=4, num_kv_heads=2,
                head_dim=16, max_position_embeddings=1024)
TINY_MOE = dict(TINY_LLM, num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32)
TINY_DIT = dataclasses.replace(WAN_1P3B, num_attention_heads=2, attention_head_dim=16, in_channels=4, out_channels=4,
                               text_dim=32, freq_dim=32, ffn_dim=64, num_layers=2)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def time_steps(step: Callable[[], None], device: torch.device, steps: int, warmup: int) -> dict:
    """Median seconds of ``step`` after ``warmup`` calls, and the peak memory of all of them."""
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    times = []
    for _ in range(steps):
        _sync(device)
        start = time.perf_counter()
        step()
        _sync(device)
        times.append(time.perf_counter() - start)
    peak = torch.cuda.max_memory_allocated(device) / 2**30 if device.type == "cuda" else 0.0
    return {"step_s": statistics.median(times[warmup:] or times), "peak_mem_gb": peak}


def _optimizer(model: torch.nn.Module, device: torch.device) -> torch.optim.Optimizer:
    return torch.optim.AdamW(model.parameters(), lr=1e-5, fused=device.type == "cuda")


def _train_step(model, optimizer, loss_fn) -> Callable[[], None]:
    def step():
        loss_fn().backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    return step


def _dtype(device: torch.device) -> torch.dtype:
    return torch.bfloat16 if device.type == "cuda" else torch.float32


def _to_training_dtype(model: torch.nn.Module, device: torch.device) -> None:
    """bf16 on a GPU, except the modules a diffusers model keeps in fp32 (as its
    ``from_pretrained(torch_dtype=...)`` does: Wan's norms, time embedder and modulation table)."""
    model.to(_dtype(device))
    keep = set(getattr(model, "_keep_in_fp32_modules", None) or ())
    for name, tensor in [*model.named_parameters(), *model.named_buffers()]:
        if keep & set(name.split(".")) and tensor.is_floating_point():
            tensor.data = tensor.data.float()


def _throughput(timing: dict, tokens: int, flops: float, peak: float) -> dict:
    return {**timing, "tokens_per_s": tokens / timing["step_s"], "mfu": flops / timing["step_s"] / peak}


def _hf_causal_lm(cfg, device: torch.device):
    import transformers

    hf_config = llm_adapter.config_to_hf(cfg)
    torch.manual_seed(0)
    return transformers.AutoModelForCausalLM.from_config(hf_config, attn_implementation="sdpa").to(device)


def llm_reference(device: torch.device, tiny: bool, peak: float) -> dict:
    """transformers' Qwen3 at the 1.7B shape: two rows of 4096 tokens a step (the recipe's shape)."""
    load_plugins()
    cfg, ours = build_model("llm", TINY_LLM if tiny else QWEN3_1P7B)
    rows, row_len = 2, 256 if tiny else 4096
    flops = ours.training_flops([row_len] * rows)  # one sequence a row: causal over all of it
    del ours
    hf = _hf_causal_lm(cfg, device).to(_dtype(device))
    ids = torch.randint(cfg.vocab_size, (rows, row_len), generator=torch.Generator().manual_seed(0)).to(device)
    step = _train_step(hf, _optimizer(hf, device), lambda: hf(input_ids=ids, labels=ids).loss)
    timing = time_steps(step, device, steps=4 if tiny else 20, warmup=1 if tiny else 5)
    return _throughput(timing, rows * row_len, flops, peak)


def _lm_batch(task, samples: list[list[int]], device: torch.device) -> dict:
    batch = task.prepare(pack_samples(samples))
    return {k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in batch.items()}


def moe_pair(device: torch.device, tiny: bool, peak: float) -> dict:
    """Our MoE decoder against transformers' Qwen3MoeForCausalLM, same weights and tokens."""
    load_plugins()
    cfg, ours = build_model("llm", TINY_MOE if tiny else QWEN3_MOE_SMALL)
    hf = _hf_causal_lm(cfg, device)
    ours.load_state_dict(llm_adapter.state_dict_from_hf(hf.state_dict(), cfg), strict=True)
    ours.to(device)
    task = get_model_spec("llm").task(cfg)
    rows, row_len = 2, 128 if tiny else 4096
    ids = torch.randint(cfg.vocab_size, (rows, row_len), generator=torch.Generator().manual_seed(0))
    batch = _lm_batch(task, ids.tolist(), device)
    ids = ids.to(device)
    with torch.no_grad():  # the same model before any timing: fp32 losses over the same tokens
        ours_loss = task(ours, batch)
        ours_loss = float(ours_loss.loss_sum) / ours_loss.loss_units
        hf_loss = float(hf(input_ids=ids, labels=ids).loss)
    if abs(ours_loss - hf_loss) > 1e-3 * abs(hf_loss):
        raise RuntimeError(f"the MoE pair disagrees before timing: loss {ours_loss:.6f} ours, {hf_loss:.6f} theirs")
    flops = ours.training_flops([row_len] * rows)
    result = {"loss_ours": ours_loss, "loss_reference": hf_loss}
    def ours_loss_fn():
        out = task(ours, batch)
        return out.loss_sum / out.loss_units

    for name, model, loss_fn in (("ours", ours, ours_loss_fn),
                                 ("reference", hf, lambda: hf(input_ids=ids, labels=ids).loss)):
        model.to(_dtype(device))
        timing = time_steps(_train_step(model, _optimizer(model, device), loss_fn), device,
                            steps=4 if tiny else 15, warmup=1 if tiny else 5)
        result[name] = _throughput(timing, rows * row_len, flops, peak)
        model.to("cpu")
        if device.type == "cuda":
            torch.cuda.empty_cache()
    return result


def dit_step(device: torch.device, tiny: bool, peak: float, frames: int, checkpointing: bool) -> dict:
    """One training step of our DiT against diffusers' WanTransformer3DModel: one clip of
    ``frames`` x 60 x 104 latents (Wan2.1-1.3B at 480p: 7,800 tokens at 5 frames, 32,760 at 21)
    and 512 text states, the same weights and inputs."""
    from diffusers import WanTransformer3DModel

    cfg = TINY_DIT if tiny else WAN_1P3B
    height, width, text_len = (8, 12, 16) if tiny else (60, 104, 512)
    frames = min(frames, 3) if tiny else frames
    torch.manual_seed(0)
    reference = WanTransformer3DModel(**{key: getattr(cfg, key) for key in ARCHITECTURE_FIELDS}).to(device)
    ours = DiTModel(cfg)
    ours.load_state_dict(dit_adapter.state_dict_from_hf(reference.state_dict(), cfg), strict=True)
    ours.to(device)
    gen = torch.Generator().manual_seed(1)
    latents = torch.randn(1, cfg.in_channels, frames, height, width, generator=gen).to(device)
    text = torch.randn(1, text_len, cfg.text_dim, generator=gen).to(device)
    timestep = torch.tensor([500.0], device=device)
    with torch.no_grad():  # equal outputs first, in fp32, on one latent frame
        got = ours.forward_video(latents[:, :, :1], timestep, text)
        want = reference(latents[:, :, :1], timestep, text).sample
    rel_l2 = float((got - want).norm() / want.norm())
    if rel_l2 > 1e-3:
        raise RuntimeError(f"our DiT and diffusers' disagree before timing: relative L2 {rel_l2:.2e}")
    if checkpointing:
        apply_activation_checkpointing(ours, ours.parallel_plan(), "full")
        reference.enable_gradient_checkpointing()
    tokens = frames * (height // 2) * (width // 2)
    flops = 3 * forward_flops(cfg, [tokens], [text_len])  # training: forward and twice that backward
    target = torch.randn(latents.shape, generator=gen).to(device)
    result = {"tokens": tokens, "fp32_rel_l2": rel_l2}
    for name, model, forward in (("ours", ours, ours.forward_video),
                                 ("reference", reference, lambda *a: reference(*a).sample)):
        _to_training_dtype(model, device)
        inputs = (latents.to(_dtype(device)), timestep, text.to(_dtype(device)))
        def loss_fn(forward=forward, inputs=inputs):
            return (forward(*inputs).float() - target).square().mean()

        timing = time_steps(_train_step(model, _optimizer(model, device), loss_fn), device,
                            steps=3 if tiny else 8, warmup=1 if tiny else 3)
        result[name] = _throughput(timing, tokens, flops, peak)
        model.to("cpu")
        if device.type == "cuda":
            torch.cuda.empty_cache()
    return result

