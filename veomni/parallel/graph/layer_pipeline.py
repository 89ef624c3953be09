"""GNNPipe: layer pipelining over the chunks of a graph, with historical embeddings.

Each pipeline rank holds one stage: a contiguous run of the model's message-passing layers (the
first stage also the input projection, the last the classifier), cut exactly as LLM stages are
(``pipeline.cut_stage``), and runs it over the *whole* graph (its data-parallel partition of it,
under the hybrid). A step (one epoch) cuts the graph into chunks, the step's micro-batches
(``veomni/data/graph/views.py``), which flow through the stages one after another: while stage
k runs chunk c, stage k-1 runs chunk c+1. A chunk's neighbours in other chunks come from each
layer's history table (``veomni/parallel/graph/halo.py``): rows written earlier this epoch, or in
the previous one. Between stages only the chunk's own rows travel (point-to-point, forward
activations and backward gradients), so the bytes per epoch are about 2 (stages - 1) |V| d,
against graph parallelism's 2 L |halo| d: GNNPipe's saving grows with the depth L.

Why not ``torch.distributed.pipelining``: its schedules size the stage buffers once from the
first micro-batch and split one batch tensor into equal micro-batches, while graph chunks have
different node counts and carry their own edges; a chunk's stage forward also depends on state
(the history) that must see the chunks in order. The schedules here are GPipe (every forward,
then every backward in reverse) and 1F1B (stage k runs ``stages - 1 - k`` warm-up forwards,
then alternates, holding at most ``stages - k`` chunks' activations). Sends are non-blocking
and receives follow the sender's order, so neither can deadlock.

Chunks are independent in autograd (their neighbours outside the chunk are history constants),
so with one chunk and no stale rows the pipeline computes exactly the one-process gradient.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from veomni.config.schema import ParallelConfig
from veomni.parallel.pipeline.layout import GRAPH_SCHEDULES, PipelineConfigError
from veomni.parallel.pipeline.p2p import recv_tensor, send_tensor
from veomni.tasks.base import LossOutput, Task


def schedule_actions(schedule: str, stage: int, n_stages: int, chunks: int) -> list[tuple[str, int]]:
    """``("F", c)`` / ``("B", c)`` in the order stage ``stage`` runs them."""
    if schedule == "GPipe":
        return [("F", c) for c in range(chunks)] + [("B", c) for c in reversed(range(chunks))]
    if schedule == "1F1B":
        warmup = min(n_stages - 1 - stage, chunks)
        actions = [("F", c) for c in range(warmup)]
        for c in range(chunks - warmup):
            actions += [("F", warmup + c), ("B", c)]
        return actions + [("B", c) for c in range(chunks - warmup, chunks)]
    raise PipelineConfigError(f"parallel.pp_schedule={schedule} is not a graph pipeline schedule; a model with "
                              f"message-passing layers pipelines with one of {', '.join(GRAPH_SCHEDULES)}")


def check_graph_stages(model: nn.Module, cfg: ParallelConfig, grad_accum: int) -> None:
    """The pipeline rules of a model with message-passing layers (a ``StageHooks`` check; other
    models pass): one stage per rank, a GPipe or 1F1B order, and one pipeline micro-batch per
    chunk."""
    if not model.parallel_plan().message_passing:
        return
    if cfg.pp_schedule not in GRAPH_SCHEDULES:
        raise PipelineConfigError(f"parallel.pp_schedule={cfg.pp_schedule}: a model with message-passing layers "
                                  f"pipelines its graph chunks with {' or '.join(GRAPH_SCHEDULES)}; set one")
    if cfg.pp_microbatches not in (0, grad_accum):
        raise PipelineConfigError(f"parallel.pp_microbatches={cfg.pp_microbatches}: a graph pipeline runs one "
                                  f"micro-batch per chunk, and the chunks are train.grad_accum={grad_accum}; "
                                  "leave pp_microbatches at 0")


class GraphPipeline:
    """This rank's stage module and the chunk schedule that drives it."""

    def __init__(self, part: nn.Module, stage: int, n_stages: int, schedule: str, pp_group: dist.ProcessGroup,
                 device: torch.device, task: Task) -> None:
        if not callable(getattr(task, "output_result", None)):
            raise TypeError(f"{type(task).__name__} cannot end a graph pipeline: it needs "
                            "output_result(output, batch) -> LossOutput (see veomni.tasks.node)")
        schedule_actions(schedule, stage, n_stages, 1)  # rejects an unknown schedule now
        self.part, self.stage, self.n_stages, self.schedule = part, stage, n_stages, schedule
        self.pp_group, self.device, self.task = pp_group, device, task
        self.is_first, self.is_last = stage == 0, stage == n_stages - 1

    def step(self, views: list[dict[str, Any]], scale: float) -> list[LossOutput]:
        """Forward and backward of every chunk; the last stage's loss of each is scaled by
        ``scale`` before backward. Returns the last stage's (unscaled) results, [] elsewhere."""
        inputs: dict[int, torch.Tensor] = {}
        outputs: dict[int, torch.Tensor] = {}
        results: dict[int, LossOutput] = {}
        pending: list[dist.Work] = []
        sent: list[torch.Tensor] = []  # kept alive until their sends complete
        for action, c in schedule_actions(self.schedule, self.stage, self.n_stages, len(views)):
            if action == "F":
                inputs[c], out = self._forward(views[c])
                if self.is_last:
                    results[c] = self.task.output_result(out, views[c])
                else:
                    sent.append(out.detach())
                    pending += send_tensor(sent[-1], self.stage + 1, self.pp_group, wait=False)
                outputs[c] = out
                continue
            out = outputs.pop(c)
            if self.is_last:
                (results[c].loss_sum * scale).backward()
            else:
                out.backward(recv_tensor(self.stage + 1, self.pp_group, self.device))
            inp = inputs.pop(c)
            if not self.is_first:
                sent.append(inp.grad if inp.grad is not None else torch.zeros_like(inp))
                pending += send_tensor(sent[-1], self.stage - 1, self.pp_group, wait=False)
        for work in pending:
            work.wait()
        return [results[c] for c in sorted(results)]

    @torch.no_grad()
    def evaluate(self, views: list[dict[str, Any]]) -> list[LossOutput]:
        """Forward only, chunk after chunk; the last stage's results ([] elsewhere)."""
        results = []
        for view in views:
            _, out = self._forward(view)
            if self.is_last:
                results.append(self.task.output_result(out, view))
            else:
                send_tensor(out, self.stage + 1, self.pp_group)
        return results

    def _forward(self, view: dict[str, Any]) -> tuple[torch.Tensor, torch.Tensor]:
        if self.is_first:
            inp = view[self.task.contract.stage_input]
        else:
            inp = recv_tensor(self.stage - 1, self.pp_group, self.device)
            inp.requires_grad_(torch.is_grad_enabled())
        return inp, self.part(inp, view)
