"""Run a function on N real gloo ranks from inside pytest.

Ranks are forked from the test process (about 0.1 s, against several seconds for spawn or
torchrun), each joins a real gloo process group, runs ``fn(rank, world_size, *args)`` and
sends back its return value. A rank that raises reports its traceback; the harness fails the
test with it instead of waiting for the other ranks to time out.
"""

from __future__ import annotations

import datetime
import io
import multiprocessing as mp
import os
import queue as queue_module
import socket
import traceback
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _worker(rank: int, world_size: int, port: int, fn: Callable, args: tuple, env: dict, queue) -> None:
    try:
        os.environ.update(env)
        # One thread: OpenMP thread pools do not survive fork() (libgomp can hang in the child).
        os.environ.update(OMP_NUM_THREADS="1", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                          WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world_size))
        torch.set_num_threads(1)
        dist.init_process_group("gloo", rank=rank, world_size=world_size,
                                timeout=datetime.timedelta(seconds=120))
        result = fn(rank, world_size, *args)
        dist.barrier()
        dist.destroy_process_group()
        buffer = io.BytesIO()  # bytes, not tensors: torch would share tensors by fd, which dies with us
        torch.save(result, buffer)
        queue.put((rank, True, buffer.getvalue()))
    except BaseException:  # report everything, including assertion errors, to the parent
        queue.put((rank, False, traceback.format_exc()))
    finally:
        queue.close()
        queue.join_thread()  # flush the result before the hard exit below
        os._exit(0)  # skip interpreter teardown in the forked child


def run_distributed(fn: Callable, world_size: int, *args: Any, timeout_s: float = 240,
                    env: dict[str, str] | None = None) -> list[Any]:
    """Return ``[fn(0, ...), ..., fn(world_size - 1, ...)]`` computed on real gloo ranks."""
    ctx = mp.get_context("fork")
    queue = ctx.Queue()
    port = _free_port()
    procs = [ctx.Process(target=_worker, args=(r, world_size, port, fn, args, env or {}, queue))
             for r in range(world_size)]
    for proc in procs:
        proc.start()
    results: dict[int, Any] = {}
    failures: list[str] = []
    try:
        for _ in range(world_size):
            try:
                rank, ok, payload = queue.get(timeout=timeout_s)
            except queue_module.Empty:
                missing = sorted(set(range(world_size)) - set(results))
                failures.append(f"ranks {missing} gave no result within {timeout_s:.0f}s (hung or died)")
                break
            if ok:
                results[rank] = torch.load(io.BytesIO(payload), weights_only=False)
            else:
                failures.append(f"rank {rank} failed:\n{payload}")
                break
    finally:
        for proc in procs:
            proc.join(timeout=5 if not failures else 0.5)
            if proc.is_alive():
                proc.kill()
    if failures:
        raise AssertionError("\n".join(failures))
    return [results[r] for r in range(world_size)]
