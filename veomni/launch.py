"""Pre-flight for ``scripts/train.sh``: everything that can be checked before workers start.

    python -m veomni.launch RECIPE.yaml --world-size N [--dry-run] [--section.key VALUE ...]

Exit status 0: the run may start (data prepared if needed); with ``--dry-run`` the resolved
config and the estimates are printed instead. Exit status 2: the recipe is wrong, and the
message says where.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
from dataclasses import replace
from pathlib import Path
from typing import Any

from veomni.config.load import ConfigError, dump_config, load_config, locate_model_error
from veomni.config.schema import LoraConfig, RunConfig, SourceConfig
from veomni.contract import get_model_spec
from veomni.contract.deprecated import deprecations_said
from veomni.data.build_loader import dataset_kind_name
from veomni.data.builders import MANIFEST
from veomni.data.kinds import get_dataset_kind
from veomni.data.mixture import run_sources
from veomni.errors import BadInput
from veomni.parallel.mesh import LayoutError, ParallelDims

NOTHING_BUILDS = "absent here, and nothing in the recipe builds"
"""How a dry run names a data input that a real launch would need and that no builder of the recipe
(``data.prepare``, ``data.sources[i].prepare``) makes, neither as one of its outputs nor beside them
(a chat set's tokenizer, a source's held-out split): a cluster's own data, or a recipe that does not
run with its one command (tests/recipes/test_every_recipe.py). A missing pretrained folder that
``checkpoint.prepare`` does not build is refused, by a dry run as by a real launch."""


def _needs_prepare(paths: dict[str, str | None]) -> bool:
    """Whether ``data.prepare`` must run: a path is missing, or holds a builder's cache
    (``manifest.json``), which the builder keeps if current and rebuilds if written by an older
    ``FORMAT_VERSION`` (a cached check takes well under a second). Folders of the user's own
    shards (no manifest) are never handed to a builder, which would replace them."""
    return any(p and (not Path(p).exists() or (Path(p) / MANIFEST).is_file()) for p in paths.values())


def _held_out(path: str) -> str:
    """Where a source's ``prepare`` writes its held-out split: ``eval`` next to a folder named
    ``train``, else ``<path>-eval``."""
    folder = Path(path)
    return str(folder.with_name("eval") if folder.name == "train" else folder.with_name(folder.name + "-eval"))


def _builds(cfg: RunConfig) -> list[tuple[str, list[str], dict[str, str | None]]]:
    """Every builder the data names: ``(key, command, the paths it writes)``: ``data.prepare`` for
    ``train_path`` / ``eval_path``, and each source's own ``prepare`` for its path (and its held-out
    split, ``_held_out``)."""
    builds = []
    if cfg.data.prepare:
        cmd = ["--train-out", cfg.data.train_path] + (["--eval-out", cfg.data.eval_path] if cfg.data.eval_path else [])
        builds.append(("data.prepare", [cfg.data.prepare, *cmd, *map(str, cfg.data.prepare_args)],
                       {"data.train_path": cfg.data.train_path, "data.eval_path": cfg.data.eval_path}))
    for index, source in enumerate(cfg.data.sources):
        if source.prepare:
            builds.append((f"data.sources[{index}].prepare",
                           [source.prepare, "--train-out", source.path, "--eval-out", _held_out(source.path),
                            *map(str, source.prepare_args)], {_source_key(index, source): source.path}))
    return builds


def _source_key(index: int, source: SourceConfig) -> str:
    return f"data.sources[{index}]" + (f" ({source.name!r})" if source.name else "")


def _check_data(cfg: RunConfig, dry_run: bool) -> tuple[list[str], list[str]]:
    """``(missing inputs as messages, the inputs a dry run plans without)``; runs the data's builders
    first where needed, except in a dry run, which only says what they would build. A dry run plans
    a cluster's recipe on a laptop: data that is absent there is named, not refused."""
    paths = {"data.train_path": cfg.data.train_path, "data.eval_path": cfg.data.eval_path}
    paths.update({_source_key(i, source): source.path for i, source in enumerate(cfg.data.sources)})
    if _data_kind(cfg).needs_tokenizer:
        paths["data.tokenizer"] = cfg.data.tokenizer
    if not cfg.data.train_path and not cfg.data.sources:
        return ["data.train_path is not set (or list weighted data.sources)"], []
    if cfg.data.prepare and cfg.data.sources:
        return ["data.prepare builds data.train_path, which data.sources replaces: give each source that needs "
                "building its own prepare (data.sources[i].prepare)"], []
    builds = _builds(cfg)
    for key, (script, *args), written in builds:
        if not _needs_prepare(written):
            continue
        if not Path(script).is_file():
            return [f"{key}: script not found: {script}"], []
        if dry_run:
            missing = [k for k, p in written.items() if p and not Path(p).exists()]
            if missing:
                print(f"[launch] dry run: the run builds {', '.join(missing)} first with {Path(script).name}",
                      file=sys.stderr)
            continue
        cmd = [sys.executable, script, *args]
        print(f"[launch] preparing data: {' '.join(cmd)}", file=sys.stderr, flush=True)
        if subprocess.run(cmd).returncode != 0:
            return [f"{key}: {script} failed (its output is above)"], []
    missing = {k: p for k, p in paths.items() if p and not Path(p).exists()}
    if dry_run:  # a dry run builds nothing, and plans from the recipe's declared shapes
        beside = {Path(p).parent for _, _, written in builds for p in written.values() if p}  # and what is beside
        if unbuilt := [f"{p} ({k})" for k, p in missing.items() if not any(map(Path(p).is_relative_to, beside))]:
            print(f"[launch] dry run: {NOTHING_BUILDS} {', '.join(unbuilt)}: planned without it; a real launch needs "
                  "it there", file=sys.stderr)
        return [], [f"{k} ({p})" for k, p in missing.items()]
    hint = "" if builds else " (and no data.prepare builder is set)"
    return [f"{k}: path does not exist: {p}{hint if k != 'data.tokenizer' else ''}" for k, p in missing.items()], []


def _data_kind(cfg: RunConfig) -> Any:
    return get_dataset_kind(dataset_kind_name(cfg.data, get_model_spec(cfg.model.arch).dataset))


def _check_data_plan(cfg: RunConfig, dims: ParallelDims) -> list[str]:
    """What the data section asks of the dataset kind and the layout, before any data is built: a
    mixture or balancing the kind cannot do, a balancing group that does not divide the data-parallel
    size, a source list whose weights or names are wrong."""
    try:
        kind = _data_kind(cfg)
    except ValueError as exc:
        return [f"data.kind: {exc}"]
    problems = []
    if cfg.data.balance and not kind.balances:
        problems.append(f"data.balance: the dataset kind {kind.name!r} cannot balance ranks (packed_text and "
                        "chat_media can); set data.balance: false")
    if cfg.data.sources and not kind.balances:
        problems.append(f"data.sources: the dataset kind {kind.name!r} reads one data.train_path; mixtures are "
                        "read by packed_text and chat_media")
    if cfg.data.balance_group and dims.dp_size % cfg.data.balance_group:
        problems.append(f"data.balance_group={cfg.data.balance_group} must divide the data-parallel size "
                        f"{dims.dp_size}; pick a divisor, or 0 for the ranks of one node")
    try:
        run_sources(cfg.data, "train")
    except ValueError as exc:
        problems.append(str(exc))
    return problems + kind.check_plan(cfg.data)


def _check_dataset(cfg: RunConfig, model_config: Any) -> list[str]:
    """The dataset kind's own pre-flight checks (a text kind: the sources hold records, the tokenizer
    exists and fits)."""
    try:
        kind = _data_kind(cfg)
    except ValueError as exc:
        return [f"data.kind: {exc}"]
    return kind.check(cfg.data, model_config)


def _validate_model(cfg: RunConfig) -> tuple[Any, Any, list[str]]:
    """Build on meta (no memory): the model config, the meta model, and the impossible model configs
    and parallel sizes the model cannot take."""
    import torch

    from veomni.contract import build_model
    from veomni.contract.plugin_check import plugin_problems
    from veomni.objectives import ObjectiveRequest, build_objective, objective_problems
    from veomni.parallel.apply import PIPELINE_HOOKS
    from veomni.parallel.expert import check_model_experts
    from veomni.parallel.fsdp import check_encoder_fsdp
    from veomni.parallel.media.colocate import check_media_routing
    from veomni.parallel.pipeline.layout import TooFewBlocksError
    from veomni.parallel.pipeline.stages import check_pipeline_model, check_pipeline_task
    from veomni.parallel.sequence import check_sequence_parallel

    try:
        with torch.device("meta"):
            model_cfg, model = build_model(cfg.model.arch, cfg.model.options)
    except (ValueError, TypeError) as exc:
        return None, None, [locate_model_error(cfg, exc)]
    try:
        spec = get_model_spec(cfg.model.arch)
        if contract_gaps := plugin_problems(spec, model_cfg, model, cfg.parallel.pp):  # before calling any of it
            return model_cfg, model, contract_gaps
        check_model_experts(model, cfg.parallel.ep)
        apart = PIPELINE_HOOKS.encoders_apart(model, cfg.parallel)
        if objective_gaps := objective_problems(cfg, cfg.data.kind or spec.dataset, apart):
            return model_cfg, model, objective_gaps
        build_objective(ObjectiveRequest(cfg, spec.build_task(model_cfg)))  # a ValueError says what the objective lacks
        check_pipeline_task(spec.build_task(model_cfg), cfg.parallel)  # says why first
        try:
            check_pipeline_model(model, cfg.parallel, cfg.train.grad_accum, PIPELINE_HOOKS)
        except TooFewBlocksError as exc:  # the engine counts blocks; the spec knows the key that sets them
            raise ValueError(f"{exc} (model.{spec.blocks_option}); raise model.{spec.blocks_option} or lower "
                             "parallel.pp / parallel.pp_virtual_stages") from None
        problems = (check_sequence_parallel(model, cfg.parallel.sp, cfg.parallel.cp)
                    + check_media_routing(model, cfg.parallel) + check_encoder_fsdp(model, cfg.parallel.encoder_fsdp)
                    + _sample_problems(cfg, spec) + _graph_sampling_problems(cfg, model))
        return model_cfg, model, problems
    except ValueError as exc:
        return model_cfg, model, [str(exc)]


def _graph_sampling_problems(cfg: RunConfig, model: Any) -> list[str]:
    """``data.graph_fanouts``: one fanout per message-passing layer, and no pipeline."""
    from veomni.contract.plan import flatten_plan
    from veomni.parallel.graph.aggregation import block_sampling_problems

    if not cfg.data.graph_fanouts:
        return []
    return block_sampling_problems(model, flatten_plan(model.parallel_plan()), len(cfg.data.graph_fanouts),
                                   cfg.parallel.pp)


def _sample_problems(cfg: RunConfig, spec: Any) -> list[str]:
    """``train.sample_interval`` needs a family that writes samples, and the whole model on each rank."""
    if not cfg.train.sample_interval:
        return []
    if spec.sample_writer is None:
        return [f"train.sample_interval={cfg.train.sample_interval}: model family {spec.name!r} writes no "
                "validation samples; remove train.sample_interval"]
    if cfg.parallel.pp > 1:
        return [f"train.sample_interval needs the whole model on every rank, not parallel.pp={cfg.parallel.pp}: "
                "sample afterwards with scripts/sample.sh, or set train.sample_interval: 0"]
    return []


def _resume_point(cfg: RunConfig) -> tuple[Path | None, list[str]]:
    """The checkpoint the run would resume (None: a fresh run), by the launcher's cheap check of
    recorded sizes, and why ``checkpoint.resume`` names none that can be resumed."""
    from veomni.checkpoint.manager import resolve_resume

    try:
        return resolve_resume(cfg.checkpoint.resume, Path(cfg.train.output_dir) / "checkpoints"), []
    except BadInput as exc:
        return None, [str(exc)]


def _check_pretrained(cfg: RunConfig, model: Any, resumed: Path | None) -> list[str]:
    """What is wrong with ``checkpoint.init`` / ``init_from_hf``, from the folders' config.json against
    the meta model's sub-modules (no weights are read); and a frozen part nothing loads. Checked
    whenever a start loads them (``loads_pretrained``: a fresh run, and a LoRA run's every start)."""
    from veomni.checkpoint.component_init import check_init, frozen_problems, init_entries
    from veomni.checkpoint.lora_run import loads_pretrained

    try:
        entries = init_entries(cfg.checkpoint)
    except BadInput as exc:
        return [str(exc)]
    if not loads_pretrained(cfg, resuming=resumed is not None):
        return []
    return check_init(model, entries) + frozen_problems(model, entries)


def _check_resume(cfg: RunConfig, model_cfg: Any, model: Any, resumed: Path | None) -> list[str]:
    """A checkpoint the run would resume that another kind of run wrote (full or LoRA, another model,
    another LoRA base), refused before a worker fails to load it (``veomni/checkpoint/run_identity.py``).
    ``model``: the meta model, adapted by ``_check_lora``."""
    from veomni.checkpoint.run_identity import resume_problems

    return [] if resumed is None else resume_problems(resumed, cfg, model_cfg, model)


def _check_lora(cfg: RunConfig, model: Any) -> list[str]:
    """The ``lora`` section on the meta model (adapted in place: run it after the checks of the
    plain model): patterns that match nothing, contradictions with the model's own freezing; a
    frozen base nothing loads is said, not refused (``veomni/checkpoint/lora_checks.py``)."""
    from veomni.checkpoint.lora_checks import check_lora

    problems, warnings = check_lora(model, cfg)
    for warning in warnings:
        print(f"[launch] warning: {warning}", file=sys.stderr)
    return problems


def _prepare_init(cfg: RunConfig, dry_run: bool) -> tuple[list[str], bool]:
    """Run ``checkpoint.prepare`` when a folder it builds (``init_from_hf``, else every ``checkpoint.init``
    folder, under their common parent) is missing, or holds a builder's ``manifest.json`` (the builder
    keeps a current folder, rebuilds an older version's): ``(problems, whether the folders are left for
    the real run to build)``; a dry run builds nothing."""
    script, ckpt = cfg.checkpoint.prepare, cfg.checkpoint
    if not script:
        return [], False
    folders = [ckpt.init_from_hf] if ckpt.init_from_hf else list(ckpt.init.values())
    if not folders:
        return ["checkpoint.prepare builds checkpoint.init_from_hf, which is not set (nor checkpoint.init)"], False
    if all(Path(f).exists() and (dry_run or not (Path(f) / MANIFEST).is_file()) for f in folders):
        return [], False
    if not Path(script).is_file():
        return [f"checkpoint.prepare: script not found: {script}"], False
    out = folders[0] if ckpt.init_from_hf else os.path.commonpath(folders)
    if dry_run:
        key = "checkpoint.init_from_hf" if ckpt.init_from_hf else "checkpoint.init"
        print(f"[launch] dry run: the run builds {key} ({out}) first with {Path(script).name}; planned from the "
              "recipe", file=sys.stderr)
        return [], True
    cmd = [sys.executable, script, "--out", out, *map(str, ckpt.prepare_args)]
    print(f"[launch] preparing the initial weights: {' '.join(cmd)}", file=sys.stderr, flush=True)
    if subprocess.run(cmd).returncode != 0:
        return [f"checkpoint.prepare: {script} failed (its output is above)"], False
    return [], False


def _say_model_source(cfg: RunConfig) -> None:
    """Which model options came from the ``init_from_hf`` folder's config.json, and which the recipe sets."""
    from veomni.config.pretrained import folder_keys

    from_folder, from_recipe = folder_keys(cfg)
    if from_folder:
        print(f"[launch] model section from {cfg.checkpoint.init_from_hf}/config.json (arch {cfg.model.arch}); "
              f"the recipe sets {', '.join(from_recipe) or 'nothing'}", file=sys.stderr)


def _fail(problems: list[str]) -> int:
    """Report problems the recipe must fix (also in a dry run: that plan could not run) and return
    the exit status that says so."""
    for problem in problems:
        print(f"config error: {problem}", file=sys.stderr)
    return 2


def main(argv: list[str] | None = None) -> int:
    from veomni.optim.check import optimizer_problems, uses_muon
    from veomni.planner.muon_plan_report import muon_report_lines

    parser = argparse.ArgumentParser(prog="veomni.launch", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("recipe")
    parser.add_argument("--launcher-world-size", type=int, default=1, help=argparse.SUPPRESS)
    parser.add_argument("--launch-settings", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--world-size", type=int, default=None,
                        help="with --dry-run: plan for this many ranks instead of this machine's")
    parser.add_argument("--gpus", action="store_true", help="the workers run (or, with --dry-run, would run) on GPUs")
    parser.add_argument("--dry-run", action="store_true")
    args, overrides = parser.parse_known_args(argv)
    if args.world_size is not None and not args.dry_run:
        print("config error: --world-size only plans a --dry-run; set NNODES and NPROC_PER_NODE to change "
              "the real world size", file=sys.stderr)
        return 2
    world_size = args.world_size or args.launcher_world_size
    with deprecations_said():  # the plug-ins are imported and the task built here
        try:
            cfg = load_config(args.recipe, overrides)
            dims = ParallelDims.resolve(cfg.parallel, world_size)
        except (ConfigError, LayoutError) as exc:
            print(f"config error: {exc}", file=sys.stderr)
            return 2
        init_problems, built_later = _prepare_init(cfg, args.dry_run)  # first: the model section may come from it
        if init_problems:
            return _fail(init_problems)
        if cfg.checkpoint.prepare and not built_later:  # (re)built: read the model section from the folder as it is
            try:
                cfg = load_config(args.recipe, overrides)
            except ConfigError as exc:
                return _fail([str(exc)])
        _say_model_source(cfg)
        model_cfg, model, problems = _validate_model(cfg)
    if model is not None:  # a recipe with other problems is checked no further
        resumed, resume_errors = _resume_point(cfg)
        problems += resume_errors
        if not built_later:
            problems += _check_pretrained(cfg, model, resumed)
        problems += _check_lora(cfg, model)
        if not problems:  # the model and its adapters are what the recipe says: compare the checkpoint's
            problems += _check_resume(cfg, model_cfg, model, resumed)
        if not problems:  # on the model as it trains (LoRA's adapters added)
            problems += optimizer_problems(model, cfg.train, cfg.optim,
                                           get_model_spec(cfg.model.arch).param_rules(model_cfg))
    problems += _check_data_plan(cfg, dims)
    if problems:  # no data is built for a run that cannot start
        return _fail(problems)
    # the same checks, in the same order, with the same messages in a dry run: only no data is built
    problems, absent = _check_data(cfg, args.dry_run)
    if absent:
        print(f"[launch] dry run: absent here, so planned from the recipe's declared shapes: {'; '.join(absent)}. "
              f"Skipped until they exist: the {_data_kind(cfg).name!r} dataset kind's checks of the data "
              "(records, shapes, tokenizer fit)", file=sys.stderr)
    elif not problems:
        problems = _check_dataset(cfg, model_cfg)
    if problems:
        return _fail(problems)
    if args.dry_run:
        from veomni.planner.estimate import estimate, format_report

        device = f"{world_size} x {'GPU (bf16 compute)' if args.gpus else 'CPU (fp32)'}"
        print("# resolved config\n" + dump_config(cfg))
        full = estimate(replace(cfg, lora=LoraConfig()), dims, args.gpus) if cfg.lora.rank > 0 else None
        print("# plan\n" + format_report(cfg, dims, estimate(cfg, dims, args.gpus), device, full))
        if uses_muon(cfg):
            rules = get_model_spec(cfg.model.arch).param_rules(model_cfg)
            print("\n".join(muon_report_lines(model, cfg, dims, rules)))
        return 0
    if args.launch_settings:
        _write_launch_settings(Path(args.launch_settings), cfg)
    return 0


def _write_launch_settings(path: Path, cfg: RunConfig) -> None:
    """What ``scripts/train.sh`` needs from the recipe to start torchrun, as shell assignments."""
    path.write_text(f"MAX_RESTARTS={cfg.train.max_restarts}\n")


if __name__ == "__main__":
    sys.exit(main())
