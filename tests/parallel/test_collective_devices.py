"""Every collective a real run makes uses a device its process group serves, as the groups are
configured on a GPU.

The first `train.sh` on a GPU died before step 1: a CPU scalar all-reduced over an NCCL-only
group. A CPU run cannot show that by running, since gloo serves everything here; what it can do
is record every collective (a dispatch mode sees each ``c10d`` op with its tensors and group)
and check the device types of its tensors against what that group would serve on a GPU:
``veomni.train.distributed.process_group_backend(cuda)`` for the groups that inherit the
default's backend. Each recorded tensor's device type is checked against what its group serves;
on a GPU the run's own tensors are CUDA and its host-side values stay on the CPU, and this run
cannot tell them apart, so a tensor recorded on the CPU needs both served. Planted records (a CUDA
tensor over a CPU-only group next to a CPU one over the same group) show that the check reads
devices, not only backends (issue 47).

The runs cover the trainer and its services (step, guard, data feed with a balanced mixture,
checkpoints, stragglers, baseline, eval), a pipeline (pp=2) and the VLM with balanced encoders
(media routing).
"""

from __future__ import annotations

import traceback
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from harness.gloo_ranks import run_distributed
from tests.train.test_data_trainer import _config as data_config
from tests.train.test_data_trainer import _vlm_config
from tests.train.test_pipeline_trainer import _config as pipeline_config
from veomni.config.schema import ParallelConfig
from veomni.train.distributed import process_group_backend
from veomni.train.trainer import Trainer

DEFAULT = "(the default group's)"


class CollectiveRecorder(TorchDispatchMode):
    """Records ``(op, group backend, device types, caller)`` for every collective run under it."""

    def __init__(self):
        super().__init__()
        self.records: list[tuple[str, str, set[str], str]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func.namespace in ("c10d", "_c10d_functional"):
            leaves = tree_leaves((args, kwargs or {}))
            devices = {t.device.type for t in leaves if isinstance(t, torch.Tensor)}
            self.records.append((str(func), _group_backend(leaves), devices, _caller()))
        return func(*args, **(kwargs or {}))


def _group_backend(leaves) -> str:
    """The backend of the collective's group, or ``DEFAULT`` if it is the default group's (which
    a group created without a backend of its own inherits)."""
    backend = dist.get_backend()
    for leaf in leaves:
        if isinstance(leaf, torch.ScriptObject):
            backend = dist.get_backend(dist.ProcessGroup.unbox(leaf))
            break
        if isinstance(leaf, str) and leaf:  # functional collectives name their group
            try:
                backend = dist.get_backend(dist.distributed_c10d._resolve_process_group(leaf))
                break
            except (ValueError, RuntimeError):
                continue
    return DEFAULT if backend == dist.get_backend() else backend


def _caller() -> str:
    frames = [f for f in traceback.extract_stack() if "/veomni/" in f.filename]
    return f"{Path(frames[-1].filename).name}:{frames[-1].lineno}" if frames else "?"


def backend_serves(backend: str) -> set[str]:
    """The device types a process group created with ``backend`` serves (``"nccl"``: CUDA only)."""
    return set(dist.BackendConfig(dist.Backend(backend)).get_device_backend_map())


def as_on_a_gpu(records, gpu_default: str) -> list[tuple[str, str, set[str], str]]:
    """The records of this CPU run as a GPU run would make them: groups that inherit the default's
    backend get the GPU default (a group created with its own backend keeps it), and each tensor
    recorded on the CPU may be either device there (the run's own tensors move to CUDA, its
    host-side values stay on the CPU; this run cannot tell them apart), so it needs both served."""
    return [(op, gpu_default if backend == DEFAULT else backend,
             devices | ({"cuda"} if "cpu" in devices else set()), caller)
            for op, backend, devices, caller in records]


def _run(rank, world, tmp, case):
    if case == "trainer":
        cfg = data_config(tmp, True, True)
        cfg.train.straggler_window = 2
    elif case == "pipeline":
        cfg = pipeline_config(tmp, 2, tied=True, max_steps=2)
    else:
        cfg = _vlm_config(tmp)
        cfg.parallel = ParallelConfig(encoder_balance=True)
    cfg.train.max_steps = min(cfg.train.max_steps, 4)
    recorder = CollectiveRecorder()
    with recorder:
        Trainer(cfg).train()
    return recorder.records


def unserved(records) -> list[str]:
    """Each collective whose tensors include a device type its group's backend does not serve,
    naming the op, its caller, the unserved devices and the backend."""
    return sorted({f"{op} at {caller}: {sorted(missing)} tensors over a group that would be {backend!r}"
                   for op, backend, devices, caller in records
                   if (missing := devices - backend_serves(backend))})


@pytest.fixture(scope="module", params=["trainer", "pipeline", "vlm"])
def records(request, tmp_path_factory) -> list:
    tmp = str(tmp_path_factory.mktemp(request.param))
    return [r for rank in run_distributed(_run, 2, tmp, request.param) for r in rank]


def test_every_collective_meets_a_device_its_group_serves_on_a_gpu(records):
    assert len(records) > 20, "the run made too few collectives to say anything"
    assert unserved(as_on_a_gpu(records, process_group_backend(torch.device("cuda")))) == []


def test_an_nccl_only_group_would_be_caught(records):
    """The backend main had before the fix (``nccl`` alone) fails this check on the same records
    for the reason it failed on the GPU: CPU tensors; a collective without tensors needs nothing."""
    lines = unserved(as_on_a_gpu(records, "nccl"))
    assert lines and all("['cpu'] tensors over a group that would be 'nccl'" in line for line in lines)
    assert unserved([("c10d.barrier", "nccl", set(), "planted")]) == []


def test_the_check_reads_each_tensors_device(records):
    """Real records of a GPU-shaped run plus planted ones on a group created as ``cpu:gloo`` (serves
    the CPU only): the same group passes a CPU tensor and fails a CUDA one, naming that collective
    alone; so a wrong-device tensor is caught whatever the backend's other devices (issue 47)."""
    op = records[0][0]
    gpu_run = as_on_a_gpu(records, process_group_backend(torch.device("cuda")))
    planted = [(op, "cpu:gloo", {"cpu"}, "host.py:1"), (op, "cpu:gloo", {"cuda"}, "model.py:2")]
    assert unserved(gpu_run + planted) == [f"{op} at model.py:2: ['cuda'] tensors over a group that would be "
                                           "'cpu:gloo'"]
