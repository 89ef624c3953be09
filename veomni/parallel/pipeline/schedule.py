"""A pipeline at run time: this rank's stages and the ``torch.distributed.pipelining`` schedule
that drives them over a step's micro-batches, and the forward-only walk of eval (``stages.py``
cuts and builds the stages).

Loss. The last stage computes each micro-batch's summed loss times ``scale`` (the caller's
``loss_size / global_units``, the same normalisation as without pipelining) and the schedule
runs with ``scale_grads=False``, so gradients equal the one-process gradients of the step. The
schedule hands the loss function the micro-batch's index (its "target"), which finds the whole
row: ``task.output_loss(output, row[contract.target])``, or for a ``RowLossTask``
(``veomni/tasks/staged.py``: a loss over whole samples, with fields from passes of its own)
``task.row_loss(output, row)`` after ``task.row_fields(rows)`` has run on every rank.
MoE models also tie each stage's auxiliary losses to its output and sum its expert loads,
through the stage-output hook ``step`` accepts (``veomni/train/moe_stats.PipelineMoEStats``).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.pipelining import PipelineStage
from torch.distributed.pipelining.schedules import PipelineScheduleSingle, get_schedule_class

from veomni.config.schema import ParallelConfig
from veomni.parallel.pipeline.layout import stage_ids, virtual_stages
from veomni.parallel.pipeline.p2p import recv_tensor, send_tensor
from veomni.parallel.pipeline.stage_hooks import StageEncoders
from veomni.parallel.pipeline.tied import TiedCopies
from veomni.tasks.base import Task
from veomni.tasks.staged import RowLossTask

# Added to an error in a pipeline's first step: its likeliest cause, which no launch check sees (no batch).
FIRST_STEP_NOTE = ("parallel.pp: this failed in the pipeline's first step. Every stage runs the model's forward with "
                   "the pieces it does not own replaced by nn.Identity: work in forward between the stage pieces "
                   "(pooling before the head, say) runs on every stage and changes what the next stage receives; "
                   "move it into a piece (docs/adding_a_model.md, 'Pipeline parallelism').")

StageOutputHook = Callable[[nn.Module, torch.Tensor], torch.Tensor]
"""``hook(stage_module, output) -> output`` after each training forward of a stage."""


def _differentiable_output(module: nn.Module, args: Any, output: Any) -> Any:
    """A training forward's hidden state that does not require grad (nothing before it trains: a
    LoRA run's frozen embedding and first blocks) made a leaf that does, so the next stage's input
    requires grad: the zero-bubble schedules' split backward finds a stage's weight gradients on
    the paths from its inputs, and computes none for a later stage whose inputs need none."""
    if torch.is_grad_enabled() and isinstance(output, torch.Tensor) and output.is_floating_point() \
            and not output.requires_grad:
        return output.detach().requires_grad_()
    return None


class _Stage(PipelineStage):
    """A ``PipelineStage`` whose training forwards pass their output through ``on_output``. Hooked
    here, not with a module forward hook: the schedule also runs each stage once on placeholder
    inputs to learn the shapes it sends, and that forward must not count."""

    on_output: StageOutputHook | None = None

    def forward_maybe_with_nosync(self, *args: Any, **kwargs: Any) -> Any:
        output = super().forward_maybe_with_nosync(*args, **kwargs)
        return output if self.on_output is None else self.on_output(self.submod, output)


class Pipeline:
    """This rank's stage modules and the schedule that drives them.

    The task gives a micro-batch's summed loss (module doc); ``step`` multiplies it by the step's
    ``scale`` before backward and returns the unscaled sum of this rank's last-stage micro-batches
    (0 on other ranks), leaving a ``RowLossTask``'s metrics of them in ``row_metrics``.
    """

    def __init__(self, parts: list[nn.Module], stage_indices: list[int], cfg: ParallelConfig, microbatches: int,
                 pp_group: dist.ProcessGroup, device: torch.device,
                 task: Task, encoders: StageEncoders | None = None,
                 tied: list[dict[int, str]] | None = None) -> None:
        self.parts, self.stage_indices = parts, stage_indices
        self.encoders = encoders
        self.microbatches = microbatches
        self.task, self.contract = task, task.contract
        self.row_task = task if isinstance(task, RowLossTask) else None
        self._scale = 1.0
        self._rows: list[dict[str, Any]] = []
        self.row_metrics: dict[int, dict[str, tuple[torch.Tensor, int]]] = {}
        """The last step's ``row_loss`` metrics by micro-batch (last stages only; keyed, so the
        schedule's extra loss call of its first step, on placeholder shapes, is overwritten)."""
        self._row_tokens: int | None = None
        self._stepped = False
        n_stages = cfg.pp * virtual_stages(cfg)
        self.n_stages, self.pp_group, self.device = n_stages, pp_group, device
        self.pp_rank = dist.get_rank(pp_group)
        self._owner = {i: r for r in range(cfg.pp)
                       for i in stage_ids(r, cfg.pp, virtual_stages(cfg), cfg.pp_schedule)}
        self._by_index = dict(zip(stage_indices, parts))
        self.stages = [_Stage(part, index, n_stages, device, group=pp_group)
                       for part, index in zip(parts, stage_indices)]
        for stage in self.stages:
            if not stage.is_last:
                stage.submod.register_forward_hook(_differentiable_output)
        self.has_last_stage = any(s.is_last for s in self.stages)
        self.has_first_stage = 0 in stage_indices
        self.tied = TiedCopies(tied, parts, stage_indices, self._owner, pp_group) if tied else None
        schedule_cls = get_schedule_class(cfg.pp_schedule)
        single = issubclass(schedule_cls, PipelineScheduleSingle)
        self.schedule = schedule_cls(self.stages[0] if single else self.stages, n_microbatches=microbatches,
                                     loss_fn=self._scaled_loss, scale_grads=False)

    @property
    def uncounted(self) -> list[nn.Parameter]:
        """Parameters that grad-norm clipping must leave out of the norm: the tied copies past the
        first (``tied.py``)."""
        return self.tied.uncounted if self.tied is not None else []

    @property
    def modules(self) -> list[nn.Module]:
        """Every module this rank holds and steps: its stages, then the encoders when they run
        outside the stages (``hooks.media``)."""
        return self.parts + ([self.encoders.part] if self.encoders is not None else [])

    def _with_row_fields(self, rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
        return self.row_task.row_fields(rows) if self.row_task is not None else rows

    def _row_loss(self, output: torch.Tensor, row: dict[str, Any],
                  metrics: bool) -> tuple[torch.Tensor, dict[str, tuple[torch.Tensor, int]]]:
        """The row's summed loss from the last stage's ``output``, and its task metrics when
        ``metrics`` (a ``RowLossTask`` always gives them)."""
        if self.row_task is not None:
            out = self.row_task.row_loss(output, row)
            return out.loss_sum, out.metrics
        target = row[self.contract.target]
        return self.task.output_loss(output, target), self.task.output_metrics(output, target) if metrics else {}

    def _scaled_loss(self, output: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
        """The schedule's loss function; its "target" is the micro-batch's index in the step."""
        loss, metrics = self._row_loss(output, self._rows[int(index)], metrics=False)
        if metrics:
            self.row_metrics[int(index)] = metrics
        return loss * self._scale

    def step(self, rows: list[dict[str, Any]], scale: float, on_output: StageOutputHook | None = None) -> float:
        """Forward and backward over ``rows`` (one per micro-batch, same token count).
        ``on_output`` sees (and may replace) every stage output of this step's forwards, e.g. to
        join a stage's auxiliary losses to backward (``moe_stats.PipelineMoEStats``)."""
        if len(rows) != self.microbatches:
            raise ValueError(f"the pipeline runs {self.microbatches} micro-batches per step, got {len(rows)}")
        sizes = {self.contract.row_length(row) for row in rows}
        self._row_tokens = self._row_tokens or min(sizes)
        if sizes != {self._row_tokens}:
            raise ValueError(f"pipeline micro-batches must all hold {self._row_tokens} tokens (the stages' "
                             f"buffers are sized once), got {sorted(sizes)}; pad them with pad_row")
        self._scale = scale
        rows = self._rows = self._with_row_fields(rows)
        self.row_metrics = {}
        args = [(row[self.contract.stage_input],) for row in rows]
        kwargs = [self._stage_kwargs(row, media) for row, media in zip(rows, self._media(rows))]
        losses: list[torch.Tensor] = []
        # What ``schedule.step`` does, minus its splitting of one batch tensor into equal chunks:
        # packed rows come already cut, with per-row boundaries.
        for stage in self.stages:
            stage.has_backward = True
            stage.clear_runtime_states()
            stage.on_output = on_output
        try:
            self.schedule._step_microbatches(args, kwargs, [torch.tensor(i) for i in range(len(rows))], losses,
                                             return_outputs=False)
        except Exception as exc:
            if not self._stepped:
                exc.add_note(FIRST_STEP_NOTE)
            raise
        finally:
            self._rows = []
            for stage in self.stages:
                stage.on_output = None
        if self.encoders is not None:  # the cool-down: the features' gradients are all in
            self.encoders.backward()
        if self.tied is not None:  # every copy of a tied parameter gets the one-process gradient
            self.tied.sync()
        self._stepped = True
        return sum(float(loss.detach()) for loss in losses) / scale if losses else 0.0

    @torch.no_grad()
    def evaluate(self, rows: list[dict[str, Any]]) -> tuple[float, list[dict[str, tuple[torch.Tensor, int]]]]:
        """Forward only; the summed loss of the rows and each row's task metrics on the last stage
        (0 and none elsewhere)."""
        loss_sum, metrics = 0.0, []
        rows = self._with_row_fields(rows)
        for row, output in zip(rows, self.forward_rows(rows)):
            if output is not None:
                loss, row_metrics = self._row_loss(output, row, metrics=True)
                loss_sum += float(loss)
                metrics.append(row_metrics)
        return loss_sum, metrics

    def forward_rows(self, rows: list[dict[str, Any]],
                     parts: Sequence[nn.Module] | None = None) -> Iterator[torch.Tensor | None]:
        """Per row, forward only, the last stage's output (None on ranks without the last stage);
        ``parts``: this rank's stages of another model cut the same way (a frozen reference), run
        instead of the policy's. Every rank of the pipeline must draw every item.

        Not through the schedule: this torch's runtime schedules cannot run forward-only in the V
        layout (the local stage-to-stage hand-off expects a backward). Rows walk the stages in
        order instead, hidden states sent point-to-point with a small shape header.
        """
        by_index = self._by_index if parts is None else dict(zip(self.stage_indices, parts))
        for row, media in zip(rows, self._media(rows)):
            kwargs = self._stage_kwargs(row, media)
            x = row[self.contract.stage_input]
            for index in range(self.n_stages):
                owner, previous = self._owner[index], self._owner.get(index - 1)
                if owner != self.pp_rank:
                    if previous == self.pp_rank:
                        send_tensor(x, owner, self.pp_group)
                    continue
                if previous is not None and previous != self.pp_rank:
                    x = recv_tensor(previous, self.pp_group, self.device)
                x = by_index[index](x, **kwargs)
            yield x if self.has_last_stage else None

    def _media(self, rows: list[dict[str, Any]]) -> list[Any]:
        """Per row, what the first stage gets as its media input: the encoded features when the
        encoders run outside the stages (encoded now, on every rank), else the row's own media
        (the first stage runs its encoders inline); None for models without media."""
        if self.encoders is not None:
            return self.encoders.encode(rows)
        field = self.contract.media
        return [row.get(field) if field else None for row in rows]

    def _stage_kwargs(self, row: dict[str, Any], media: Any = None) -> dict[str, Any]:
        """What every stage gets besides the hidden state: the contract's stage keyword inputs
        (``max_seqlen`` as an int), the count of real rows before the row's padding (MoE
        layers route only those) and, on the first stage's rank, the row's ``media``. (Every
        stage of a rank gets the same keywords: models with media run one stage per rank.)"""
        kwargs = {k: int(row[k]) if k == "max_seqlen" else row[k] for k in self.contract.stage_kwargs}
        if self.contract.media and self.has_first_stage:
            kwargs[self.contract.media] = media
        return {**kwargs, "valid_tokens": row.get("valid_tokens")}
