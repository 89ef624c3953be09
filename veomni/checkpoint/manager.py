"""Distributed checkpoints that a crash can never corrupt.

Layout under ``<output_dir>/checkpoints/``::

    step_00000100/            a published, complete checkpoint
        .metadata, *.distcp   model + optimizer + scheduler + trainer state (DCP, resharding)
        rank_00000.pt ...     per-rank state: data-loader position and RNG (tensors and plain
                              values only: read with ``weights_only=True``, never as code)
        complete.json         written last, before the rename; marks the folder complete and
                              records every file's size and SHA-256 (``verify.py``)
    .step_00000200.tmp/       a save in progress (ignored by resume, removed on the next save)

Every rank writes into the ``.tmp`` folder; rank 0 writes ``complete.json`` and renames the
folder only after all ranks have finished, so ``step_*`` folders are always whole. Old
checkpoints beyond ``keep_last`` are removed only after the new one is published.

Model and optimizer state go through ``torch.distributed.checkpoint`` with full FQNs, so a
checkpoint loads at any world size or FSDP layout. Under pipeline parallelism a rank holds
several stage modules with disjoint original parameter names; their model and (flattened,
FQN-keyed) optimizer entries are united into one dict, so pipeline sizes reshard like any other
layout change. Loader and RNG state are per rank; what a resume does with them (same layout,
or merged across a changed one) is ``veomni/train/restore.py``'s decision.
"""

from __future__ import annotations

import json
import logging
import os
import pickle
import re
import shutil
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)

from veomni.checkpoint.run_identity import key_problems, mismatch_message, stored_shapes
from veomni.checkpoint.verify import (
    COMPLETE_MARKER,
    FILES_KEY,
    checkpoint_files,
    choose_checkpoint,
    digest,
    file_problems,
    recorded_files,
    share,
    size_problems,
)
from veomni.errors import BadCheckpoint, MissingInput
from veomni.optim.container import OptimizerSet

logger = logging.getLogger(__name__)

EMA_APP_KEY = "ema"
"""A checkpoint's exponential moving average of the weights lives in its app state under this key,
as ``{parameter FQN: tensor}`` (DCP keys ``app.ema.<fqn>``)."""

_OPTIM = StateDictOptions(flatten_optimizer_state_dict=True)
"""Optimizer entries keyed ``state.<param fqn>.<name>`` / ``param_groups.<param fqn>.<key>``:
stage modules' entries never collide and unite into one dict."""


def _parts(model) -> list:
    return list(model) if isinstance(model, (list, tuple)) else [model]


def _optimizers(optimizer) -> list:
    """Per model part, its optimizers (several: Muon and AdamW over one part)."""
    return list(optimizer.per_part) if isinstance(optimizer, OptimizerSet) else [[optimizer]]


def _stage_state(model, optimizer, trainable_only: bool = False) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """Per stage module: its model state dict (``trainable_only``: without the frozen parameters)
    and its optimizer's flattened state dict."""
    parts, optims = _parts(model), _optimizers(optimizer)
    if len(parts) != len(optims):
        raise ValueError(f"{len(parts)} model parts but {len(optims)} optimizers; expected one optimizer per part")
    return ([_model_state(p, trainable_only) for p in parts],
            [get_optimizer_state_dict(p, o, options=_OPTIM) for p, o in zip(parts, optims)])


def _model_state(part, trainable_only: bool) -> dict[str, Any]:
    """``get_model_state_dict``, without the frozen parameters when ``trainable_only`` (every name
    of a tied one: DCP's own ``ignore_frozen_params`` keeps a tied parameter's second name)."""
    state = get_model_state_dict(part)
    if not trainable_only:
        return state
    frozen = {".".join(s for s in name.split(".") if s not in WRAPPER_SEGMENTS)
              for name, p in part.named_parameters(remove_duplicate=False) if not p.requires_grad}
    return {k: v for k, v in state.items() if k not in frozen}


WRAPPER_SEGMENTS = ("_checkpoint_wrapped_module", "_orig_mod", "_fsdp_wrapped_module")
"""Name segments activation checkpointing, compile and FSDP add, which state-dict keys leave out."""


def _union(dicts: list[dict[str, Any]]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for d in dicts:
        out.update(d)
    return out


class CheckpointSaveError(RuntimeError):
    """A save failed before publishing; earlier checkpoints are intact."""


_STEP_DIR = re.compile(r"^step_(\d+)$")


def step_dir_name(step: int) -> str:
    return f"step_{step:08d}"


def step_of(path: str | os.PathLike) -> int | None:
    """The step of a ``step_*`` checkpoint folder (None for any other name)."""
    match = _STEP_DIR.match(Path(path).name)
    return int(match.group(1)) if match else None


def list_checkpoints(root: Path) -> list[tuple[int, Path]]:
    """Complete checkpoints under ``root`` as (step, path), oldest first."""
    if not root.is_dir():
        return []
    found = []
    for child in root.iterdir():
        step = step_of(child)
        if step is not None and (child / COMPLETE_MARKER).is_file():
            found.append((step, child))
    return sorted(found)


def resume_candidates(resume: str, root: Path, run_id: str | None = None) -> tuple[list[Path], bool]:
    """The checkpoints ``resume`` allows, newest first, and whether the recipe named one folder.
    ``run_id``: a restarted worker group's run (torchrun's ``TORCHELASTIC_RUN_ID``), whose own
    checkpoints come first whatever ``resume`` says: a restart continues the run it restarts."""
    newest_first = [path for _, path in reversed(list_checkpoints(root))]
    own = [path for path in newest_first
           if run_id and json.loads((path / COMPLETE_MARKER).read_text()).get("run_id") == run_id]
    if resume == "none":
        return own, False
    if resume == "auto":
        return own + [path for path in newest_first if path not in own], False
    path = Path(resume)
    if not (path / COMPLETE_MARKER).is_file():
        raise MissingInput(
            f"checkpoint.resume={resume}: not a complete checkpoint (no {COMPLETE_MARKER}); "
            f"complete ones under {root}: {[p.name for _, p in list_checkpoints(root)] or 'none'}"
        )
    return own + [path], not own


def resolve_resume(resume: str, root: Path, run_id: str | None = None,
                   problems: Callable[[Path], list[str]] = size_problems) -> Path | None:
    """The checkpoint to resume from, or None for a fresh run: the first of ``resume_candidates``
    without ``problems`` (by default the launcher's cheap check of recorded sizes; the workers pass
    their agreed hash check). See ``choose_checkpoint``."""
    candidates, explicit = resume_candidates(resume, root, run_id)
    return choose_checkpoint(candidates, problems, explicit, root)


@dataclass
class _PendingSave:
    step: int
    tmp: Path
    future: Future | None


class CheckpointManager:
    """Saves and restores the whole training state; one instance per rank."""

    def __init__(self, root: Path, keep_last: int, async_save: bool, layout: dict[str, Any],
                 trainable_only: bool = False) -> None:
        """``trainable_only``: checkpoints leave out the frozen parameters (a LoRA run's base, which
        every start rebuilds from the recipe that ``layout["frozen_base"]`` records)."""
        self.root = root
        self.trainable_only = trainable_only
        self.keep_last = keep_last
        self.async_save = async_save
        self.layout = layout
        self.rank = dist.get_rank()
        self._pending: _PendingSave | None = None
        # Async saves run collectives from a background thread: they get their own gloo
        # group so they never interleave with the training collectives.
        self._async_group = dist.new_group(backend="gloo") if async_save else None

    # ----- save -------------------------------------------------------------------------
    def save(self, step: int, model, optimizer, app_state: dict[str, Any], rank_state: dict[str, Any]) -> None:
        """Write a checkpoint for ``step``. ``model`` is a module or this rank's list of pipeline
        stage modules (then ``optimizer.per_part`` holds each stage's optimizers).
        ``app_state`` is identical on all ranks (scheduler, counters); ``rank_state`` differs
        per rank (loader, RNG)."""
        self.wait()
        tmp = self.root / f".{step_dir_name(step)}.tmp"
        if self.rank == 0:
            if tmp.exists():
                shutil.rmtree(tmp)
            tmp.mkdir(parents=True)
        dist.barrier()
        torch.save(rank_state, tmp / f"rank_{self.rank:05d}.pt")  # plain values and tensors only
        models, optims = _stage_state(model, optimizer, self.trainable_only)
        state = {"model": _union(models), "optim": _union(optims), "app": app_state}
        if self.async_save:
            future = dcp.async_save(state, checkpoint_id=str(tmp), process_group=self._async_group)
            self._pending = _PendingSave(step, tmp, future)
        else:
            try:
                dcp.save(state, checkpoint_id=str(tmp))
            except CheckpointException as exc:  # a BaseException in DCP; make it an ordinary error
                raise CheckpointSaveError(
                    f"saving the checkpoint of step {step} failed ({exc}); nothing was published and the "
                    f"previous checkpoints under {self.root} are untouched"
                ) from exc
            self._pending = _PendingSave(step, tmp, None)
            self._publish()

    def poll(self) -> None:
        """Publish a finished async save without blocking (call once per step)."""
        if self._pending and self._pending.future is not None and self._pending.future.done():
            self._publish()

    def wait(self) -> None:
        """Block until any save in flight is published (before the next save and at exit)."""
        if self._pending is not None:
            self._publish()

    def _publish(self) -> None:
        pending, self._pending = self._pending, None
        if pending.future is not None:
            pending.future.result()
        # The DCP save finishes with a gather to rank 0, so once rank 0's save returned every
        # rank's shards are on disk; the barrier also covers the per-rank files.
        group = self._async_group if pending.future is not None else None
        dist.barrier(group=group)
        files = self._digests(pending.tmp, group)
        if self.rank == 0:
            meta = {"step": pending.step, **self.layout, FILES_KEY: files}
            (pending.tmp / COMPLETE_MARKER).write_text(json.dumps(meta, indent=1))
            final = self.root / step_dir_name(pending.step)
            if final.exists():
                shutil.rmtree(final)
            os.replace(pending.tmp, final)
            self._prune()
            logger.info("checkpoint published: %s", final)
        dist.barrier(group=group)

    @staticmethod
    def _digests(folder: Path, group: dist.ProcessGroup | None) -> dict[str, dict]:
        """Size and SHA-256 of every file of ``folder``, each rank hashing its share."""
        names = checkpoint_files(folder)
        mine = {name: digest(folder / name) for name in share(names, dist.get_rank(group), dist.get_world_size(group))}
        gathered: list[dict] = [{} for _ in range(dist.get_world_size(group))]
        dist.all_gather_object(gathered, mine, group=group)
        return {name: entry for part in gathered for name, entry in sorted(part.items())}

    def choose_resume(self, resume: str, own_run: str | None) -> Path | None:
        """The checkpoint this run resumes from (None: a fresh run), verified by every rank
        (``problems``); ``own_run``: a restarted worker group's run id, whose newest checkpoint
        wins over ``checkpoint.resume``. ValueError / FileNotFoundError when the only candidates
        are damaged or missing."""
        return resolve_resume(resume, self.root, own_run, self.problems)

    def problems(self, path: Path) -> list[str]:
        """What is wrong with the files of checkpoint ``path`` (sizes and hashes against complete.json),
        each rank checking its share; the same list on every rank."""
        recorded = recorded_files(path)
        if recorded is None:
            logger.warning("%s records no checksums (saved by an older version): loading it unchecked", path)
            return []
        mine = file_problems(path, recorded, share(sorted(recorded), self.rank, dist.get_world_size()), hashes=True)
        gathered: list[list[str]] = [[] for _ in range(dist.get_world_size())]
        dist.all_gather_object(gathered, mine)
        return sorted(p for part in gathered for p in part)

    def _prune(self) -> None:
        found = list_checkpoints(self.root)
        for _, path in found[: max(0, len(found) - self.keep_last)]:
            shutil.rmtree(path, ignore_errors=True)
        for stale in self.root.glob(".step_*.tmp"):
            shutil.rmtree(stale, ignore_errors=True)

    # ----- load -------------------------------------------------------------------------
    def load(self, path: Path, model, optimizer, app_state: dict[str, Any],
             tied: dict[str, list[str]] | None = None) -> tuple[dict, list[dict] | None]:
        """Restore model/optimizer in place and ``app_state`` values; return
        (saved layout, per-rank states of the saved run, or None if unreadable). ``tied`` maps a
        parameter name to the other names of its parameter (``pipeline_tied.aliases``): an entry
        the checkpoint lacks under one name is read under another (a one-process run keys a tied
        parameter's optimizer state by its first name only; a pipeline's last stage asks for the
        head's)."""
        models, optims = _stage_state(model, optimizer, self.trainable_only)
        state = {"model": _union(models), "optim": _union(optims), "app": app_state}
        twins: dict[str, list[tuple[str, Any, str]]] = {}
        stored = stored_shapes(path)
        if tied:
            twins = {section: _read_through(state[section], section, set(stored), tied)
                     for section in ("model", "optim")}
        wanted = {k: tuple(v.shape) for k, v in state["model"].items() if isinstance(v, torch.Tensor)}
        if problems := key_problems(path, wanted, stored):  # the same on every rank: stop, never restart
            raise BadCheckpoint(mismatch_message(path, problems))
        dcp.load(state, checkpoint_id=str(path))
        for section, pairs in twins.items():
            for key, value, twin in pairs:
                _take(state[section], key, value, twin)
        # dcp.load fills tensors in place but replaces plain values (learning rates, steps) in
        # the united dicts: read each stage's entries back from them.
        for part, optim, model_sd, optim_sd in zip(_parts(model), _optimizers(optimizer), models, optims):
            set_model_state_dict(part, {k: state["model"][k] for k in model_sd},
                                 options=StateDictOptions(strict=not self.trainable_only))
            set_optimizer_state_dict(part, optim, {k: state["optim"][k] for k in optim_sd}, options=_OPTIM)
        meta = json.loads((path / COMPLETE_MARKER).read_text())
        rank_files = sorted(path.glob("rank_*.pt"))
        rank_states = [load_rank_state(f) for f in rank_files]
        layout = {k: v for k, v in meta.items() if k not in ("step", FILES_KEY)}
        logger.info("resumed from %s (saved at step %d, layout %s)", path, meta["step"], layout)
        return meta, rank_states


def _read_through(entries: dict[str, Any], section: str, stored: set[str],
                  tied: dict[str, list[str]]) -> list[tuple[str, Any, str]]:
    """Take out of ``entries`` each key the checkpoint lacks and request a stored key of a tied twin
    name in its place (its value, unless this rank wants that key itself: both copies on one
    rank); return (key, value, twin key) for ``_take`` after loading."""
    taken = []
    for key in [k for k in entries if f"{section}.{k}" not in stored]:
        for name, others in tied.items():
            if f".{name}." not in f".{key}.":
                continue
            twin = next((t for t in (f".{key}.".replace(f".{name}.", f".{o}.")[1:-1] for o in others)
                         if f"{section}.{t}" in stored), None)
            if twin is not None:
                value = entries.pop(key)
                entries.setdefault(twin, value)
                taken.append((key, value, twin))
                break
    return taken


def _take(entries: dict[str, Any], key: str, value: Any, twin: str) -> None:
    """After loading, what was read under ``twin`` back under ``key`` (into ``value`` in place
    when it is a tensor another key was read into)."""
    loaded = entries[twin]
    if isinstance(value, torch.Tensor) and value is not loaded:
        value.copy_(loaded)
        loaded = value
    entries[key] = loaded


def load_rank_state(path: Path) -> dict[str, Any]:
    """A per-rank state file, read as data: ``weights_only=True`` refuses any pickled object that
    would run code on load (a checkpoint folder from someone else must not execute anything)."""
    try:
        return torch.load(path, weights_only=True)
    except pickle.UnpicklingError as exc:
        raise BadCheckpoint(f"{path} holds a pickled object other than tensors and plain values; refusing to load "
                            f"it, since unpickling it could run code ({str(exc).splitlines()[0]}). A checkpoint "
                            "written by this project never holds one: take the checkpoint from a source you trust"
                            ) from None
