"""Every collective a real run makes uses a device its process group serves, as the groups are
configured on a GPU.

The first `train.sh` on a GPU died before step 1: a CPU scalar all-reduced over an NCCL-only
group. A CPU run cannot show that by running, since gloo serves everything here; what it can do
is record every collective (a dispatch mode sees each ``c10d`` op with its tensors and group)
and check the device types of its tensors against what that group would serve on a GPU:
``veomni.train.distributed.process_group_backend(cuda)`` for the groups that inherit the
default's backend. On a GPU the run's own tensors are CUDA and its host-side values stay on the
CPU, so the group must serve both; every recorded collective is checked against that pair.

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

ON_A_GPU = {"cpu", "cuda"}  # the devices a GPU run hands to collectives: its own and the host's
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


def _as_on_a_gpu(backend: str, gpu_default: str) -> str:
    """The backend a group recorded on this CPU run has on a GPU: groups that inherit the
    default's get the GPU default; a group created with its own backend keeps it."""
    return gpu_default if backend == DEFAULT else backend


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


def _unserved(records, gpu_default: str) -> list[str]:
    return sorted({f"{op} at {caller}: {sorted(devices)} over a group that would be {backend!r}"
                   for op, recorded, devices, caller in records
                   if not ON_A_GPU <= backend_serves(backend := _as_on_a_gpu(recorded, gpu_default))})


@pytest.fixture(scope="module", params=["trainer", "pipeline", "vlm"])
def records(request, tmp_path_factory) -> list:
    tmp = str(tmp_path_factory.mktemp(request.param))
    return [r for rank in run_distributed(_run, 2, tmp, request.param) for r in rank]


def test_every_collective_meets_a_device_its_group_serves_on_a_gpu(records):
    assert len(records) > 20, "the run made too few collectives to say anything"
    gpu_default = process_group_backend(torch.device("cuda"))
    assert _unserved(records, gpu_default) == []


def test_an_nccl_only_group_would_be_caught(records):
    """The backend main had before the fix (``nccl`` alone) fails this check on the same records,
    naming the call sites of the host-side collectives."""
    unserved = _unserved(records, "nccl")
    assert unserved and all("over a group that would be 'nccl'" in line for line in unserved)
