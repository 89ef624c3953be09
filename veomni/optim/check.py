"""The launcher's optimizer checks, on the meta model before any worker starts: every optimizer
the recipe names is registered, every ``optim.groups`` pattern matches a trainable parameter,
and the groups each optimizer would get are ones it takes (Muon: matrices only)."""

from __future__ import annotations

from collections.abc import Sequence

from torch import nn

from veomni.config.schema import OptimConfig, RunConfig, TrainConfig
from veomni.contract.hooks import ParamRule
from veomni.contract.plan import module_path_matches
from veomni.optim.groups import clean_name, optimizer_groups
from veomni.optim.registry import get_optimizer


def uses_muon(cfg: RunConfig) -> bool:
    """The run names Muon (for the run, or for a group): ``--dry-run`` then shows its owner plan."""
    return cfg.train.optimizer == "muon" or any(g.optimizer == "muon" for g in cfg.optim.groups)


def optimizer_problems(model: nn.Module, train: TrainConfig, optim: OptimConfig, rules: Sequence[ParamRule] = ()
                       ) -> list[str]:
    named = [("train.optimizer", train.optimizer), ("optim.muon_fallback", optim.muon_fallback)]
    named += [(f"optim.groups[{i}].optimizer", g.optimizer) for i, g in enumerate(optim.groups) if g.optimizer]
    problems = []
    for where, name in named:
        try:
            get_optimizer(name, where)
        except ValueError as exc:
            problems.append(str(exc))
    if optim.muon_split_balance and optim.muon_split_balance < 1:
        problems.append(f"optim.muon_split_balance {optim.muon_split_balance} is below 1, which no plan reaches "
                        "(it is max / mean per rank): give a value >= 1, or 0 never to split a matrix's iteration")
    names = [clean_name(n) for n, p in model.named_parameters() if p.requires_grad]
    for index, group in enumerate(optim.groups):
        if not group.pattern:
            problems.append(f"optim.groups[{index}].pattern is empty: give a parameter-name glob")
        elif not any(module_path_matches(name, group.pattern) for name in names):
            problems.append(f"optim.groups[{index}].pattern {group.pattern!r} matches no trainable parameter "
                            f"(for example: {', '.join(names[:3])})")
    if problems:
        return problems
    for name, groups in optimizer_groups(model, train, optim, rules).items():
        try:
            get_optimizer(name).build(groups, train, optim)
        except ValueError as exc:
            problems.append(f"optimizer {name!r}: {exc}")
    return problems
