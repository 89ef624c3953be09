"""The one training loop: every model family, every parallel layout.

Set-up (process group, mesh, the family's spec, its task, the step runner, data, resume), then
steps of ``grad_accum`` micro-batches per data-parallel rank (the step math is in ``step.py``,
the layout-specific part in ``runners/``), periodic eval and checkpoints, metrics, and an end
of run that says what was learned.

Everything family-specific comes from the model spec (``veomni.contract``): how to build the model,
the task (whose batch contract says what a micro-batch is), the dataset kind, the cost model and
the parameter rules. The trainer itself assumes no field names and no tokenizer.
"""

from __future__ import annotations

import itertools
import logging
import signal
import threading
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from veomni.adapters.lora import is_adapter_name, trainable_counts
from veomni.adapters.peft_io import init_adapters
from veomni.checkpoint.component_init import init_entries, load_components
from veomni.checkpoint.lora_run import frozen_base, loads_pretrained
from veomni.checkpoint.manager import CheckpointManager
from veomni.checkpoint.run_identity import IDENTITY_KEY, run_identity
from veomni.config.load import config_to_dict, dump_config
from veomni.config.schema import RunConfig
from veomni.contract import build_config, get_model_spec, load_plugins
from veomni.data.build_loader import run_data
from veomni.data.feed import build_feed
from veomni.errors import BadInput
from veomni.objectives import FeedRequest, FrozenModels, ObjectiveRequest, build_objective
from veomni.parallel.comm_counter import COMM_COUNTER
from veomni.parallel.comm_counter import KINDS as COMM_KINDS
from veomni.parallel.mesh import ParallelDims, build_mesh
from veomni.parallel.row_split import shard_batch
from veomni.tasks.base import Baseline, EvalBatch, Task, batch_to_device, count_samples, task_generator
from veomni.train.distributed import all_gather_values, all_reduce_values, init_distributed
from veomni.train.ema import WeightEMA
from veomni.train.fault.injection import FaultInjector
from veomni.train.fault.recovery import BadStepRecovery
from veomni.train.fault.restart import restart_attempt, restart_record, run_id
from veomni.train.fault.shared_fs import check_shared_output_dir
from veomni.train.fault.stop import RunStopped
from veomni.train.fault.stragglers import StragglerDetector
from veomni.train.fault.watchdog import Watchdog, process_group_timeout_s
from veomni.train.report.baseline import BaselineCollector
from veomni.train.report.metrics import StepTimer, device_peak_flops, peak_memory_gb
from veomni.train.report.sinks import MetricsReporter
from veomni.train.restore import RunState, app_state, rank_state, restore
from veomni.train.run_end import RunEnd
from veomni.train.runners.build import build_frozen_copy, build_runner

logger = logging.getLogger(__name__)


class Trainer(RunEnd):
    def __init__(self, cfg: RunConfig, task: Task | None = None, launch: Sequence[str] | None = None) -> None:
        """``launch``: the recipe and overrides the run was started with (``scripts/train.sh``'s
        arguments), for the next commands the end-of-run summary suggests; None: the output
        folder's resolved ``config.yaml`` stands in for them."""
        self._started = time.perf_counter()
        self.cfg = cfg
        self.device = init_distributed(cfg.train.device, process_group_timeout_s(cfg.train.collective_timeout_s))
        self.rank = dist.get_rank()
        self.watchdog = Watchdog.for_run(cfg.train.collective_timeout_s, Path(cfg.train.output_dir), self.rank,
                                         dist.get_world_size(), dist.get_backend())
        self.output_dir = Path(cfg.train.output_dir)
        self.launch = list(launch) if launch else [str(self.output_dir / "config.yaml")]
        check_shared_output_dir(self.output_dir, cfg.train.shared_fs_timeout_s)  # makes it on every node
        self.dims = ParallelDims.resolve(cfg.parallel, dist.get_world_size())
        self.meshes = build_mesh(self.dims, self.device.type)
        self.settings = config_to_dict(cfg)  # what config.yaml and the metric sinks record
        if self.rank == 0:
            (self.output_dir / "config.yaml").write_text(dump_config(self.settings))
        logger.info("layout: %s", self.dims.describe())

        load_plugins(cfg.model.plugins)
        self.spec = get_model_spec(cfg.model.arch)
        self.model_config = build_config(cfg.model.arch, cfg.model.options)
        self.objective = build_objective(ObjectiveRequest(cfg, task or self.spec.build_task(self.model_config)))
        self.task = self.objective.task
        self.unit = self.task.contract.unit
        self.checkpoints = CheckpointManager(
            self.output_dir / "checkpoints", cfg.checkpoint.keep_last, cfg.checkpoint.async_save,
            layout={"world_size": self.dims.world_size, "dp_size": self.dims.dp_size,
                    "num_workers": cfg.data.num_workers, "run_id": run_id(), "frozen_base": frozen_base(cfg),
                    IDENTITY_KEY: run_identity(cfg, self.model_config)},
            trainable_only=cfg.lora.rank > 0,
        )
        try:
            self.resume_path = self.checkpoints.choose_resume(cfg.checkpoint.resume,
                                                              run_id() if restart_attempt() else None)
        except BadInput as exc:  # damaged or missing: the same on every rank
            raise RunStopped(str(exc)) from None
        torch.manual_seed(cfg.train.seed)
        self.param_counts: tuple[int, int] | None = None  # (trainable, all), counted on rank 0's full copy
        self.runner = build_runner(cfg, self.spec, self.model_config, self.task, self.meshes, self.device,
                                   self._initialise)
        if self.objective.attach is not None:
            self.objective.attach(FrozenModels(self.runner.whole_model, self._frozen_copy, cfg.lora.rank > 0,
                                               self.meshes.row.get_group() if self.dims.row_ranks > 1 else None,
                                               self.runner.pipeline))
        torch.manual_seed(cfg.train.seed)  # only rank 0 drew init values: realign every rank's RNG
        self.parts, self.model = self.runner.parts, self.runner.whole_model
        self.faults = FaultInjector(self.rank)
        self.faults.attach(self.parts)
        self.optimizer, self.scheduler = self.runner.optimizer, self.runner.scheduler
        self.ema = WeightEMA(self.parts, cfg.train.ema_decay) if cfg.train.ema_decay else None
        self.sample_writer = self.spec.sample_writer(self.model_config, cfg.data) \
            if cfg.train.sample_interval and self.spec.sample_writer else None

        self.data = run_data(cfg.data, self.spec.dataset, self.meshes.dp_rank, self.dims.dp_size, cfg.train.seed,
                             self.model_config, cfg.train.grad_accum)
        self.tokenizer = self.data.tokenizer
        self.train_loader = self.data.loader("train")
        if cfg.data.balance:
            self.train_loader.dataset.unpacked = True  # single samples: the feed packs them after balancing
        self.run_state = RunState(self.parts, self.optimizer, self.scheduler, self.ema, self.runner.tied,
                                  self.train_loader, self.meshes.dp_rank, self.dims.dp_size, cfg.data.num_workers)
        self._pending: list[list[Any]] = []  # a balancing window to restore
        self.step, self.units_seen, self._last_saved_step = 0, 0, -1
        if self.resume_path is not None:
            self._restore(self.resume_path)
        self.feed = build_feed(cfg, self.train_loader, self.meshes, self.spec, self.device, self._pending,
                               all_reduce_values)
        if self.objective.feed is not None:
            world = dist.group.WORLD if self.dims.world_size > 1 else None
            self.feed = self.objective.feed(FeedRequest(self.feed, self.tokenizer, self.device, world,
                                                        self.meshes.dp.get_group() if self.dims.dp_size > 1 else None,
                                                        cfg.train.seed, self.meshes.dp_rank, self.step,
                                                        self.model_config))
        # goes into the next step's metrics only
        self._once: dict[str, Any] = restart_record(self.output_dir, self.step, cfg.train.max_restarts)
        self._timer = StepTimer()
        self._last_eval_step = -1
        self.last_eval: dict[str, float] = {}
        self.baseline: Baseline | None = None
        self.preempted = False
        self._signal_received: int | None = None
        if threading.current_thread() is threading.main_thread():
            signal.signal(signal.SIGTERM, self._on_stop_signal)
            signal.signal(signal.SIGINT, self._on_stop_signal)

        self.stragglers = StragglerDetector.for_run(cfg.train.straggler_factor, cfg.train.straggler_window,
                                                    self.meshes.pp.get_local_rank())
        peak, self.peak_source = device_peak_flops(self.device)
        self.peak_flops = all_reduce_values([peak], group=self.meshes.loss.get_group())[0] / self.dims.loss_size
        logger.info("MFU peak: %s", self.peak_source)
        self.reporter = MetricsReporter(self.output_dir, cfg.log, self.settings, cfg.train.max_steps,
                                        self.step, enabled=self.rank == 0, throughput_key=self._key("s_per_s"))
        self.recovery = BadStepRecovery(self.runner.guard, cfg.train.max_bad_steps, cfg.train.on_bad_steps,
                                        self.checkpoints, self.reporter.log, self._restore_weights, restart_attempt())

    def _on_stop_signal(self, signum: int, frame: Any) -> None:
        """A requested stop (a scheduler's SIGTERM, Ctrl-C): finish the current step, checkpoint,
        summarise, exit 0 (ranks agree in run_step)."""
        self._signal_received = signum

    def _key(self, suffix: str) -> str:
        """A metric named after the task's unit: ``tokens_per_s`` for ``_key("s_per_s")``."""
        return f"{self.unit}{suffix}"

    # ----- state ------------------------------------------------------------------------
    def _initialise(self, model: torch.nn.Module) -> None:
        """Rank 0's full copy: seeded init, then for a fresh run the pretrained folders of
        ``checkpoint.init_from_hf`` (the whole model) and ``checkpoint.init`` (sub-modules); a LoRA
        run loads them at every start (its checkpoints hold only what trains), then its adapters."""
        model.init_weights()
        if loads_pretrained(self.cfg, resuming=self.resume_path is not None):  # a LoRA checkpoint holds no base
            for line in load_components(model, init_entries(self.cfg.checkpoint), is_adapter_name):
                logger.info(line)
        self.param_counts = trainable_counts(model)
        for line in init_adapters(model, self.cfg.lora, self.spec.hf_adapter, self.model_config,
                                  resuming=self.resume_path is not None):
            logger.info(line)

    def _frozen_copy(self) -> torch.nn.Module:
        """The model at its starting weights, sharded like the trained one and frozen (an objective's
        reference): the same seeded init and pretrained folders, also when this run resumes."""
        def initialise(model: torch.nn.Module) -> None:
            model.init_weights()
            for line in load_components(model, init_entries(self.cfg.checkpoint), is_adapter_name):
                logger.info("frozen copy: %s", line)

        torch.manual_seed(self.cfg.train.seed)  # the draws that initialised the trained model
        return build_frozen_copy(self.cfg, self.spec, self.model_config, self.meshes, self.device, initialise)

    def _app_state(self) -> dict[str, Any]:
        return app_state(self.run_state, self.step, self.units_seen)

    def _rank_state(self) -> dict[str, Any]:
        return rank_state(self.run_state, self.feed.pending_state())

    def save_checkpoint(self) -> None:
        self.watchdog.beat(f"checkpoint save at step {self.step}")
        self.checkpoints.save(self.step, self.parts, self.optimizer, self._app_state(), self._rank_state())
        self._last_saved_step = self.step

    def _restore(self, path: Path, data: bool = True) -> int:
        """Checkpoint ``path`` into this run, as ``veomni/train/restore.py`` decides (``data``: the
        data position and RNG too); returns the step it was saved at."""
        self.watchdog.beat(f"checkpoint load from {path}")
        restored = restore(path, self.checkpoints, self.run_state, data)
        self.step = self._last_saved_step = restored.step
        self.units_seen = restored.units_seen
        if restored.pending is not None:
            self._pending = restored.pending
        return self.step

    def _restore_weights(self, path: Path) -> int:
        """A rollback's restore: the data position and RNG go on."""
        return self._restore(path, data=False)

    @property
    def rollbacks(self) -> int:
        return self.recovery.rollbacks

    # ----- steps ------------------------------------------------------------------------
    def _local(self, batch: dict[str, Any], generator: torch.Generator, training: bool = True) -> dict[str, Any]:
        """This rank's part of a loader batch (its positions under SP/CP), on the device. The
        task draws its randomness on the whole row, before slicing. A runner that joins rows
        before slicing them (``shards_rows``: the pipeline) gets the whole row."""
        batch = self.task.prepare(batch, generator, training=training)
        if self.dims.row_ranks > 1 and not self.runner.shards_rows:
            batch = shard_batch(batch, self.meshes.row_split, self.task.contract)
        return batch_to_device(batch, self.device)

    def _next_micro_batches(self) -> list[dict[str, Any]]:
        self.faults.before_step(self.step + 1)
        seed, dp_rank = self.cfg.train.seed, self.meshes.dp_rank
        return [self._local(batch, task_generator(seed, self.step, i, dp_rank))
                for i, batch in enumerate(self.feed.next_step())]

    def train_step(self, micro_batches: list[dict[str, Any]]) -> dict[str, Any]:
        """One optimizer step over this rank's micro-batches; returns global metrics (generic names)
        with the bytes the engine's collectives sent, summed over the ranks, per kind."""
        with COMM_COUNTER.measure() as counter:
            metrics = self.runner.train_step(micro_batches)
            sent = [counter.bytes[kind] for kind in COMM_KINDS]
        totals = all_reduce_values(sent)
        metrics.update({f"comm_bytes_{kind}": int(total) for kind, total in zip(COMM_KINDS, totals) if total})
        return metrics

    @torch.no_grad()
    def evaluate(self) -> dict[str, float]:
        """``eval_loss`` (the task's loss) and ``eval_<name>`` for each extra task metric; {} without
        eval data. Also sets ``last_eval`` and ``baseline`` (the task's, on the same eval batches)."""
        if not self.cfg.data.eval_path or not self.objective.evaluates:
            return {}
        self.watchdog.beat(f"eval at step {self.step}")
        for part in self.parts:
            part.eval()
        baseline = BaselineCollector(self.task)
        result = self.runner.evaluate(baseline.observe(self._eval_batches(self.data.loader("eval"))))
        for part in self.parts:
            part.train()
        # Whole rows (the runner slices them) are the same on every cp x sp rank: add them over dp only.
        self.baseline = baseline.result((self.meshes.dp if self.runner.shards_rows else self.meshes.loss).get_group())
        if self.baseline is not None and self.baseline.loss is not None and result:
            result["eval_baseline"] = self.baseline.loss
        self.last_eval = result
        return result

    def _eval_batches(self, loader) -> Iterator[EvalBatch]:
        """This rank's eval micro-batches. Ranks run out at different times and all must run the same
        number of forwards (FSDP's all-gathers would hang): with ``train.eval_batches`` N every rank
        stops when the first runs out or at N; with 0 (the whole held-out set) a rank that ran out
        repeats its last batch, uncounted, until every rank has scored its whole share."""
        it = iter(loader)
        loss_group = self.meshes.loss.get_group()
        limit, whole = self.cfg.train.eval_batches, self.cfg.train.eval_batches == 0
        last: EvalBatch | None = None
        for index in itertools.count():
            if not whole and index >= limit:
                return
            batch = next(it, None)
            has, can = batch is not None, batch is not None or last is not None
            # one all-reduce (a max; the max of -x is -min x): any rank has a batch, every rank has
            # one, every rank can feed one
            anyone, everyone, all_can = (abs(v) for v in all_reduce_values(
                [has, -has, -can], op=dist.ReduceOp.MAX, group=loss_group))
            if not (anyone if whole else everyone) or not all_can:
                if whole and anyone and not all_can:
                    logger.warning("eval: a rank's share of the held-out set is empty, so the eval stops at the "
                                   "shortest share; use fewer processes or a larger held-out set")
                return
            if batch is None:
                yield EvalBatch(last.batch, samples=0, counted=False)
                continue
            generator = task_generator(self.cfg.train.seed, 0, index, self.meshes.dp_rank, "eval")
            last = EvalBatch(self._local(batch, generator, training=False),
                             samples=count_samples(batch, self.task.contract))
            yield last

    def _named(self, metrics: dict[str, Any]) -> dict[str, Any]:
        """The runner's generic counts renamed after the task's units (``tokens``, ``loss_tokens``; a
        preference loss's ``loss_pairs``)."""
        metrics[self._key("s")] = metrics.pop("units")
        metrics[f"loss_{self.task.contract.loss_units_name}"] = metrics.pop("loss_units")
        return metrics

    def run_step(self) -> dict[str, float]:
        """One optimizer step plus what follows it: metrics, eval and checkpoint when due."""
        cfg = self.cfg
        self.watchdog.beat(f"step {self.step + 1}")
        metrics = self._named(self.train_step(self._next_micro_batches()))
        if "skipped" in metrics:
            self.recovery.skipped(self.step, metrics)
            return metrics
        if self.ema is not None:
            self.ema.update()
        units = metrics[self._key("s")]
        self.step += 1
        self.units_seen += units
        elapsed = self._timer.lap()
        # One all-gather over the world (with pipelines the loss group leaves out the other stages):
        # maxima for the metrics, the stop flag so every rank learns of a signal at the same step, and
        # each rank's own time (outside collectives) for the straggler check.
        ranks = all_gather_values([peak_memory_gb(self.device), elapsed, float(self._signal_received is not None),
                                   elapsed - self.watchdog.waited_s()])
        peak_mem, slowest, stop, _ = (max(column) for column in zip(*ranks))
        metrics.update(self.stragglers.observe(self.step, [row[3] for row in ranks]))
        world = self.dims.world_size
        metrics.update({
            self._key("s_per_s"): units / slowest,
            self._key("s_per_s_per_device"): units / slowest / world,
            "mfu": metrics["flops"] / slowest / world / self.peak_flops,
            "peak_mem_gb": peak_mem, "step_time_s": slowest, self._key("s_seen"): self.units_seen,
        })
        metrics.update(self.recovery.counts(), **self.feed.step_metrics(), **self._once)
        self._once = {}
        if cfg.train.eval_interval and self.step % cfg.train.eval_interval == 0:
            metrics.update(self.evaluate())
            self._last_eval_step = self.step
        self.reporter.log(self.step, metrics)
        if self.sample_writer is not None and self.step % cfg.train.sample_interval == 0:
            self.write_samples()
        self.checkpoints.poll()
        self.preempted = stop > 0
        if self.preempted or (cfg.checkpoint.interval and self.step % cfg.checkpoint.interval == 0):
            self.save_checkpoint()
        self._timer.lap()  # eval and checkpoint time is not charged to the next step
        return metrics

    def train(self) -> list[dict[str, float]]:
        """Run to ``max_steps`` and finish; returns this run's per-step metrics."""
        if self.step == 0:
            logger.info("training %d steps from scratch", self.cfg.train.max_steps)
        self._timer = StepTimer()
        history = []
        while self.step < self.cfg.train.max_steps and not self.preempted:
            metrics = self.run_step()
            if "skipped" not in metrics:
                history.append(metrics)
        if self.preempted:
            self.stopped_end(history)
        else:
            self.finish(history)
        self.watchdog.stop()
        return history
