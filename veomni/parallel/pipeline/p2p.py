"""Point-to-point tensors of any shape between pipeline ranks: a small header (dtype, shape)
then the payload, so the receiver needs no shape agreed in advance. Used where a schedule's
per-micro-batch shapes vary (a pipeline's eval walk, a graph pipeline's chunks). Payload bytes
are counted (``pp_p2p``); an empty tensor sends its header only."""

from __future__ import annotations

import torch
import torch.distributed as dist

from veomni.parallel.comm_counter import COMM_COUNTER

_DTYPES = [torch.float32, torch.bfloat16, torch.float16, torch.float64, torch.int64]
_MAX_DIMS = 8


def send_tensor(x: torch.Tensor, to: int, group: dist.ProcessGroup, wait: bool = True) -> list[dist.Work]:
    """Send ``x`` to group rank ``to``; with ``wait=False`` the pending works are returned (keep
    ``x`` alive and wait on them before reusing it)."""
    dst = dist.get_global_rank(group, to)
    header = torch.tensor([_DTYPES.index(x.dtype), x.dim(), *x.shape, *[0] * (_MAX_DIMS - x.dim())],
                          device=x.device)
    works = [dist.isend(header, dst=dst, group=group)]
    if x.numel():
        COMM_COUNTER.record("pp_p2p", x.numel() * x.element_size())
        works.append(dist.isend(x.contiguous(), dst=dst, group=group))
    if wait:
        for work in works:
            work.wait()
        return []
    return works


def recv_tensor(source: int, group: dist.ProcessGroup, device: torch.device) -> torch.Tensor:
    """The next tensor group rank ``source`` sends."""
    src = dist.get_global_rank(group, source)
    header = torch.zeros(2 + _MAX_DIMS, dtype=torch.long, device=device)
    dist.recv(header, src=src, group=group)
    dtype, ndim = _DTYPES[int(header[0])], int(header[1])
    x = torch.empty(header[2:2 + ndim].tolist(), dtype=dtype, device=device)
    if x.numel():
        dist.recv(x, src=src, group=group)
    return x
