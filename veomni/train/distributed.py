"""Process-group start-up: device and backend picked at run time.

On a GPU the process group serves both devices: NCCL carries CUDA tensors (gradients,
activations, features) and gloo the host-side values that steer the run (loss and token
totals, guard verdicts, data counts, checkpoint and straggler bookkeeping, Python objects).
Every sub-group (the DeviceMesh dimensions) inherits that pair, so a collective cannot meet a
device its group does not serve, wherever in the engine it is called. On a CPU it is gloo.
``tests/parallel/test_collective_devices.py`` checks this against the collectives a real run makes."""

from __future__ import annotations

import datetime
import os
import socket

import torch
import torch.distributed as dist


def pick_device(preference: str) -> torch.device:
    if preference == "cuda" and not torch.cuda.is_available():
        raise RuntimeError("train.device=cuda but no CUDA device is visible; use train.device=auto or cpu")
    if preference in ("auto", "cuda") and torch.cuda.is_available():
        return torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))
    return torch.device("cpu")


def init_distributed(preference: str = "auto", timeout_s: float = 600) -> torch.device:
    """Join (or, for a plain ``python`` run, create a 1-rank) process group; return the device."""
    device = pick_device(preference)
    os.environ.setdefault("RANK", "0")
    os.environ.setdefault("WORLD_SIZE", "1")
    os.environ.setdefault("LOCAL_RANK", "0")
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    if "MASTER_PORT" not in os.environ:  # a plain 1-process run: any free port will do
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", 0))
            os.environ["MASTER_PORT"] = str(sock.getsockname()[1])
    backend = process_group_backend(device)
    if device.type == "cuda":
        torch.cuda.set_device(device)
        # NCCL's flight recorder: the watchdog dumps it when a rank hangs (veomni.train.fault.watchdog)
        os.environ.setdefault("TORCH_NCCL_TRACE_BUFFER_SIZE", "2000")
    else:
        # Several ranks share the CPU: split its cores so they do not oversubscribe it, unless
        # the launcher already decided (OMP_NUM_THREADS).
        local_world = int(os.environ.get("LOCAL_WORLD_SIZE", os.environ["WORLD_SIZE"]))
        threads = os.environ.get("OMP_NUM_THREADS") or max(1, (os.cpu_count() or 1) // local_world)
        torch.set_num_threads(int(threads))
    if not dist.is_initialized():
        timeout = datetime.timedelta(seconds=timeout_s)
        # No ``device_id``: bound to a device, DeviceMesh splits its sub-groups off the NCCL
        # communicator (``split_group``), and whether a split keeps the gloo half has changed
        # between torch releases; unbound, every sub-group is a ``new_group`` with both backends.
        dist.init_process_group(backend=backend, timeout=timeout, store=_attempt_store(timeout),
                                rank=int(os.environ["RANK"]), world_size=int(os.environ["WORLD_SIZE"]))
    return device


def process_group_backend(device: torch.device) -> str:
    """The default process group's backend for a run on ``device`` (see the module docstring)."""
    return "cpu:gloo,cuda:nccl" if device.type == "cuda" else "gloo"


def _attempt_store(timeout: datetime.timedelta) -> dist.Store:
    """The rendezvous store, with its keys under this restart attempt's prefix.

    After torchrun restarts a worker group, the agent's store still holds the keys the dead
    attempt's process groups wrote (gloo's peer addresses among them), under the same names: a new
    rank could read a dead peer's address and fail to connect ("Connection refused"), or wait on it.
    A prefix per ``TORCHELASTIC_RESTART_COUNT`` keeps every attempt to its own keys."""
    rank = int(os.environ["RANK"])
    agent_hosts_it = os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True"
    store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]),
                          int(os.environ["WORLD_SIZE"]), is_master=rank == 0 and not agent_hosts_it,
                          timeout=timeout, multi_tenant=not agent_hosts_it)
    return dist.PrefixStore(f"veomni/attempt_{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}", store)


def all_reduce_values(values: list[float], op: dist.ReduceOp = dist.ReduceOp.SUM, group=None,
                      device: torch.device | None = None) -> list[float]:
    """One collective for several scalars (each one would cost a round trip)."""
    tensor = torch.tensor(values, dtype=torch.float64, device=device)
    dist.all_reduce(tensor, op=op, group=group)
    return tensor.tolist()


def all_gather_values(values: list[float], device: torch.device | None = None) -> list[list[float]]:
    """Every rank's ``values`` (the same length on each), one row per rank, in one collective."""
    tensor = torch.tensor(values, dtype=torch.float64, device=device)
    rows = [torch.empty_like(tensor) for _ in range(dist.get_world_size())]
    dist.all_gather(rows, tensor)
    return [row.tolist() for row in rows]
