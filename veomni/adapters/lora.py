"""LoRA applied from outside, like the parallel recipes: the model is written once, a recipe's
``lora`` section adapts it.

``add_lora`` runs on the plain model, before the parallel recipe (``veomni/parallel/apply.py``),
so FSDP, EP, sequence and context parallelism, pipeline cuts, activation checkpointing and compile
see the adapted model as any other. It

- swaps each targeted ``nn.Linear`` for a ``LoRALinear`` holding the same ``weight`` / ``bias``
  (their names do not change, so pretrained folders, exports and FLOP counts still apply) plus
  ``lora_A`` [r, in] and ``lora_B`` [out, r], r and alpha per layer (``lora.rank_pattern`` /
  ``lora.alpha_pattern``, PEFT's ``rank_pattern`` / ``alpha_pattern``);
- gives each targeted grouped-expert module (``veomni.contract.hooks.AdaptableExperts``) one adapter per
  expert, ``<weight>_lora_A`` [E, r, in] and ``<weight>_lora_B`` [E, out, r], registered on the
  module itself: they lead with the expert dim, so expert parallelism shards them with the experts,
  and they run through the module's ``expert_delta`` injection point as two grouped GEMMs of rank r
  (no per-expert delta weight is ever materialised);
- freezes every other parameter except the modules ``lora.train`` names (a VLM's projector).

The adapters start as PEFT's do (``lora_A`` Kaiming-uniform, ``lora_B`` zero), so the adapted
model computes what the base computes until the first step. ``lora_A`` / ``lora_B`` are raw
parameters, not child ``nn.Linear`` modules, so a family's ``init_weights`` (which walks linear
modules) draws the same base weights with or without LoRA.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator
from contextlib import contextmanager

import torch
import torch.nn.functional as F
from torch import nn

from veomni.config.schema import LoraConfig
from veomni.contract.hooks import AdaptableExperts, ExpertGroup
from veomni.contract.plan import flatten_plan, match_modules, module_path_matches
from veomni.ops.grouped_gemm import grouped_mm

ADAPTER_SUFFIXES = ("lora_A", "lora_B")


def _suffix(name: str) -> str | None:
    leaf = name.rpartition(".")[2]
    return next((s for s in ADAPTER_SUFFIXES if leaf == s or leaf.endswith("_" + s)), None)


def is_adapter_name(name: str) -> bool:
    """Whether a parameter name is a LoRA adapter's (``...q_proj.lora_A``, ``...gate_up_proj_lora_B``)."""
    return _suffix(name) is not None


class LoRALinear(nn.Linear):
    """``y = x W^T + b + scaling * dropout(x) A^T B^T``, with ``W`` and ``b`` the frozen base's."""

    def __init__(self, base: nn.Linear, rank: int, alpha: float, rslora: bool, dropout: float) -> None:
        nn.Module.__init__(self)
        self.in_features, self.out_features = base.in_features, base.out_features
        self.weight, self.bias = base.weight, base.bias
        factory = {"device": base.weight.device, "dtype": base.weight.dtype}
        self.lora_A = nn.Parameter(torch.empty(rank, self.in_features, **factory))
        self.lora_B = nn.Parameter(torch.empty(self.out_features, rank, **factory))
        self.alpha, self.scaling = alpha, module_scaling(rank, alpha, rslora)
        self.dropout = nn.Dropout(dropout) if dropout else nn.Identity()
        self.disabled = False
        """True inside ``adapters_disabled``: the layer computes its base alone."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.disabled:
            return F.linear(x, self.weight, self.bias)
        low_rank = F.linear(F.linear(self.dropout(x), self.lora_A.to(x.dtype)), self.lora_B.to(x.dtype))
        return F.linear(x, self.weight, self.bias) + self.scaling * low_rank

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, rank={self.lora_A.shape[0]}, scaling={self.scaling:g}"


class ExpertLoRA:
    """A grouped-expert module's ``expert_delta``: ``scaling * grouped(grouped(x, A_e^T), B_e^T)``
    for the weights it adapts, through the module's ``local_weight`` (this rank's experts under EP)."""

    def __init__(self, module: nn.Module, names: tuple[str, ...], scaling: float, dropout: float) -> None:
        self.module, self.names, self.scaling = module, names, scaling
        self.dropout = nn.Dropout(dropout) if dropout else None
        self.disabled = False

    def __call__(self, name: str, x: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        if name not in self.names or self.disabled:
            return torch.zeros((), dtype=x.dtype, device=x.device)
        a = self.module.local_weight(getattr(self.module, f"{name}_lora_A")).to(x.dtype)
        b = self.module.local_weight(getattr(self.module, f"{name}_lora_B")).to(x.dtype)
        rows = self.dropout(x) if self.dropout is not None and self.module.training else x
        return self.scaling * grouped_mm(grouped_mm(rows, a.transpose(1, 2), counts), b.transpose(1, 2), counts)


@contextmanager
def adapters_disabled(model: nn.Module) -> Iterator[None]:
    """Inside, every adapter of ``model`` is switched off: it computes its frozen base (a preference
    objective's reference policy under LoRA, with no second copy of the model)."""
    switches = [m for m in model.modules() if isinstance(m, LoRALinear)]
    switches += [m.expert_delta for m in model.modules()
                 if isinstance(m, AdaptableExperts) and isinstance(m.expert_delta, ExpertLoRA)]
    for switch in switches:
        switch.disabled = True
    try:
        yield
    finally:
        for switch in switches:
            switch.disabled = False


def expert_weight_names(module: nn.Module) -> tuple[str, ...]:
    """The grouped weights of an expert module ([E, out, in] parameters, not adapters)."""
    return tuple(name for name, p in module.named_parameters(recurse=False)
                 if p.ndim == 3 and not is_adapter_name(name))


def module_scaling(rank: int, alpha: float, rslora: bool) -> float:
    """PEFT's: ``alpha / r``, or ``alpha / sqrt(r)`` with rank-stabilised LoRA."""
    return alpha / math.sqrt(rank) if rslora else alpha / rank


def scaling_of(cfg: LoraConfig) -> float:
    return module_scaling(cfg.rank, cfg.alpha, cfg.rslora)


def rank_and_alpha(path: str, cfg: LoraConfig) -> tuple[int, float]:
    """The rank and alpha of the linear layer at ``path``: the first ``lora.rank_pattern`` /
    ``lora.alpha_pattern`` key that matches it (the patterns of ``lora.targets``), else
    ``lora.rank`` / ``lora.alpha``."""
    rank = next((r for pattern, r in cfg.rank_pattern.items() if _matches(path, pattern)), cfg.rank)
    alpha = next((a for pattern, a in cfg.alpha_pattern.items() if _matches(path, pattern)), cfg.alpha)
    return rank, float(alpha)


def _check_patterns(cfg: LoraConfig, linears: list[str], experts: list[str]) -> None:
    """ValueError naming a ``lora.rank_pattern`` / ``lora.alpha_pattern`` key that matches no adapted
    linear layer, or one that matches an expert group (its adapters take the section's rank and alpha:
    PEFT's ``target_parameters`` have no per-module pattern we could export), or a rank under 1."""
    for key, patterns in (("rank_pattern", cfg.rank_pattern), ("alpha_pattern", cfg.alpha_pattern)):
        for pattern, value in patterns.items():
            grouped = [p for p in experts if _matches(p, pattern)]
            if grouped:
                raise ValueError(f"lora.{key} entry {pattern!r} matches the expert group {grouped[0]}: expert "
                                 "adapters take lora.rank and lora.alpha; drop the entry or narrow it to linear "
                                 "layers")
            if not any(_matches(p, pattern) for p in linears):
                raise ValueError(f"lora.{key} entry {pattern!r} matches no adapted linear layer; they are named "
                                 f"like {', '.join(linears[:4])}")
            if key == "rank_pattern" and int(value) < 1:
                raise ValueError(f"lora.rank_pattern entry {pattern!r}: rank {value} is not a positive integer")


def _matches(path: str, pattern: str) -> bool:
    """A pattern without a dot names a module by its last segment (PEFT's ``target_modules``);
    one with dots is a path glob, ``*`` matching one segment (as the parallel plan's)."""
    if "." not in pattern and "*" not in pattern:
        return path.rpartition(".")[2] == pattern
    return module_path_matches(path, pattern)


def lora_targets(model: nn.Module, cfg: LoraConfig) -> tuple[list[tuple[str, nn.Linear]], list[tuple[str, nn.Module]]]:
    """(linear layers, grouped-expert modules) ``cfg.targets`` selects; empty targets take every
    linear layer and expert group inside the blocks of the model's own plan (PEFT's ``all-linear``:
    no head, no embedding), not its encoders' sub-plans: a VLM adapts its LLM by default and its
    encoders only when a pattern names them (``encoders.image.**``). ValueError naming an entry
    that matches nothing."""
    own = model.parallel_plan()
    plan = flatten_plan(own)
    experts = {path: m for path, m in match_modules(model, plan.experts) if isinstance(m, ExpertGroup)}
    fixed = [path for path, m in experts.items() if not isinstance(m, AdaptableExperts)]
    if cfg.targets:
        chosen = {}
        for pattern in cfg.targets:
            hits = {path: m for path, m in model.named_modules()
                    if path and _matches(path, pattern) and (isinstance(m, nn.Linear) or path in experts)}
            if not hits:
                linears = [p for p, m in model.named_modules() if isinstance(m, nn.Linear)][:6]
                raise ValueError(f"lora.targets entry {pattern!r} matches no linear layer or expert group of "
                                 f"{type(model).__name__}; linear layers are named like {', '.join(linears)}")
            chosen.update(hits)
    else:
        chosen = {path: m for _, block in match_modules(model, own.blocks) for path, m in _inside(model, block)
                  if isinstance(m, nn.Linear) or path in experts}
    refused = [p for p in chosen if p in fixed]
    if cfg.targets and refused:
        raise ValueError(f"lora.targets selects the expert group {refused[0]} of {type(model).__name__}, which has no "
                         "`expert_delta` injection point (veomni.contract.hooks.AdaptableExperts) to add its "
                         "adapters through: declare one, or leave the experts out of lora.targets")
    linears = [(p, m) for p, m in chosen.items() if p not in experts and not isinstance(m, LoRALinear)]
    return linears, [(p, m) for p, m in chosen.items() if p in experts and p not in fixed]


def _inside(model: nn.Module, block: nn.Module) -> Iterator[tuple[str, nn.Module]]:
    prefix = next(path for path, m in model.named_modules() if m is block)
    for path, m in block.named_modules():
        yield (f"{prefix}.{path}" if path else prefix), m


def adapted_model(build: Callable[[], nn.Module], cfg: LoraConfig) -> nn.Module:
    """``build()`` with ``cfg``'s adapters added (the model builder of a run)."""
    return add_lora(build(), cfg)


def add_lora(model: nn.Module, cfg: LoraConfig) -> nn.Module:
    """Adapt ``model`` in place (see the module docstring) and freeze what does not train; returns
    it. ``cfg.rank == 0`` leaves the model untouched."""
    if cfg.rank <= 0:
        return model
    scaling = scaling_of(cfg)
    linears, experts = lora_targets(model, cfg)
    if not linears and not experts:
        where = "among lora.targets" if cfg.targets else "in its blocks"
        raise ValueError(f"lora: {type(model).__name__} has no linear layer or adaptable expert group to adapt "
                         f"{where}; name modules in lora.targets")
    _check_patterns(cfg, [p for p, _ in linears], [p for p, _ in experts])
    for path, linear in linears:
        rank, alpha = rank_and_alpha(path, cfg)
        model.set_submodule(path, LoRALinear(linear, rank, alpha, cfg.rslora, cfg.dropout))
    for _, module in experts:
        names = expert_weight_names(module)
        for name in names:
            weight = getattr(module, name)
            num, out_dim, in_dim = weight.shape
            factory = {"device": weight.device, "dtype": weight.dtype}
            module.register_parameter(f"{name}_lora_A", nn.Parameter(torch.empty(num, cfg.rank, in_dim, **factory)))
            module.register_parameter(f"{name}_lora_B", nn.Parameter(torch.empty(num, out_dim, cfg.rank, **factory)))
        module.expert_delta = ExpertLoRA(module, names, scaling, cfg.dropout)
    trained = [path for path, _ in model.named_modules() if path and any(_matches(path, p) for p in cfg.train)]
    missing = [p for p in cfg.train if not any(_matches(path, p) for path in trained)]
    if missing:
        raise ValueError(f"lora.train entries {missing} match no module of {type(model).__name__}; its top-level "
                         f"modules: {', '.join(name for name, _ in model.named_children())}")
    model.requires_grad_(False)
    for name, param in model.named_parameters(remove_duplicate=False):  # a tied weight trains under either name
        if is_adapter_name(name) or any(name == t or name.startswith(t + ".") for t in trained):
            param.requires_grad_(True)
    return model


@torch.no_grad()
def init_lora(model: nn.Module, generator: torch.Generator | None = None) -> int:
    """PEFT's start: every ``lora_A`` Kaiming-uniform (a = sqrt(5), per expert for grouped ones),
    every ``lora_B`` zero. Returns the number of adapted weights."""
    count = 0
    for name, param in model.named_parameters():
        kind = _suffix(name)
        if kind == "lora_B":
            param.zero_()
        elif kind == "lora_A":
            bound = 1.0 / math.sqrt(param.shape[-1])  # kaiming_uniform_(a=sqrt(5)) on [r, in]
            param.uniform_(-bound, bound, generator=generator)
            count += 1
    return count


@torch.no_grad()
def merge_lora(state: dict[str, torch.Tensor], model: nn.Module) -> dict[str, torch.Tensor]:
    """A full state dict (``model``'s names, e.g. a checkpoint's) with each adapter folded into its
    base weight and the adapter entries dropped: what a plain, unadapted model loads."""
    merged = {k: v for k, v in state.items() if not is_adapter_name(k)}
    for path, module in model.named_modules():
        prefix = f"{path}." if path else ""
        if isinstance(module, LoRALinear):
            a, b = state[f"{prefix}lora_A"].float(), state[f"{prefix}lora_B"].float()
            base = state[f"{prefix}weight"]
            merged[f"{prefix}weight"] = (base.float() + module.scaling * (b @ a)).to(base.dtype)
        elif isinstance(module, AdaptableExperts) and isinstance(module.expert_delta, ExpertLoRA):
            for name in module.expert_delta.names:
                a, b = state[f"{prefix}{name}_lora_A"].float(), state[f"{prefix}{name}_lora_B"].float()
                base = state[f"{prefix}{name}"]
                merged[f"{prefix}{name}"] = (base.float() + module.expert_delta.scaling * (b @ a)).to(base.dtype)
    return merged


def trainable_counts(model: nn.Module) -> tuple[int, int]:
    """(trainable parameters, all parameters), a tied parameter counted once."""
    seen: dict[int, nn.Parameter] = {id(p): p for p in model.parameters()}
    total = sum(p.numel() for p in seen.values())
    return sum(p.numel() for p in seen.values() if p.requires_grad), total


def base_dtype(cfg: LoraConfig, device_type: str, mixed_precision: str) -> torch.dtype | None:
    """The dtype the frozen base is stored in: bf16 on a GPU under bf16 compute (``auto``: when
    ``parallel.mixed_precision`` is auto or bf16), fp32 on the CPU and under fp32 compute; None
    without LoRA (the parameters keep their dtype)."""
    if cfg.rank <= 0:
        return None
    if cfg.base_dtype == "fp32" or device_type == "cpu":
        return torch.float32
    if cfg.base_dtype == "bf16":
        return torch.bfloat16
    return torch.bfloat16 if mixed_precision in ("auto", "bf16") else torch.float32
