"""Start-up check that every rank sees one and the same ``train.output_dir``.

Every rank writes its part of each checkpoint into ``output_dir`` and reads the others' parts back
on resume, so the folder must live on a filesystem that every node mounts at the same path. Nodes
that each have their own folder (a node-local disk, or a path that differs between nodes) would
otherwise train to the first checkpoint and fail there with a raw collective error, losing the
run. So, before the model is built: rank 0 writes a marker holding a random token into
``output_dir`` (under a temporary name, then ``os.replace``, so no rank reads half a file), the
token reaches every rank by a broadcast, each rank waits up to ``train.shared_fs_timeout_s`` for
the marker to appear (a network filesystem may show a new file only once its attribute cache
expires), and the ranks gather who saw it. If any rank did not, every rank raises ``RunStopped``
with the same message, which names the hosts and ranks that could not see the folder; a restart
would meet the same filesystems, so torchrun must not retry.
"""

from __future__ import annotations

import os
import secrets
import socket
import time
from dataclasses import dataclass
from pathlib import Path

import torch.distributed as dist

from veomni.train.fault.stop import RunStopped

MARKER_PREFIX = ".shared_fs_check_"


@dataclass(frozen=True)
class Sighting:
    """What one rank found in its ``output_dir``."""

    rank: int
    host: str
    output_dir: str
    seen: bool
    problem: str  # why the folder could not be made or read ("" when there was none)


def check_shared_output_dir(output_dir: Path, timeout_s: float, poll_s: float = 0.1) -> None:
    """Return once every rank has seen rank 0's marker in ``output_dir``; otherwise raise
    ``RunStopped`` on every rank. Every rank creates its ``output_dir`` first, so a node without
    the shared folder fails this check, not a later write."""
    rank = dist.get_rank()
    folder = os.path.abspath(output_dir)
    problem = _make_folder(folder)
    token = secrets.token_hex(8) if rank == 0 else ""
    if rank == 0 and not problem:
        problem = _write_marker(folder, token)
    shared = [token, problem, folder, socket.gethostname()]  # rank 0's, after the broadcast
    dist.broadcast_object_list(shared, src=0)
    token, writer_problem, writer_folder, writer_host = shared
    if writer_problem:
        raise RunStopped(f"rank 0 on {writer_host} could not write to train.output_dir {writer_folder}: "
                         f"{writer_problem}. Set train.output_dir to a folder every node can write to.")
    marker = os.path.join(folder, MARKER_PREFIX + token)
    seen, problem = (False, problem) if problem else _wait_for_marker(marker, token, timeout_s, poll_s)
    sightings: list[Sighting | None] = [None] * dist.get_world_size()
    dist.all_gather_object(sightings, Sighting(rank, socket.gethostname(), folder, seen, problem))
    if rank == 0:
        Path(marker).unlink(missing_ok=True)
    blind = [s for s in sightings if s is not None and not s.seen]
    if blind:
        raise RunStopped(_not_shared_message(sightings[0], blind, timeout_s))


def _make_folder(folder: str) -> str:
    try:
        os.makedirs(folder, exist_ok=True)
    except OSError as exc:
        return f"cannot create it ({exc.strerror or exc})"
    return ""


def _write_marker(folder: str, token: str) -> str:
    final = os.path.join(folder, MARKER_PREFIX + token)
    try:
        with open(final + ".tmp", "w") as f:
            f.write(token)
        os.replace(final + ".tmp", final)
    except OSError as exc:
        return exc.strerror or str(exc)
    return ""


def _wait_for_marker(marker: str, token: str, timeout_s: float, poll_s: float) -> tuple[bool, str]:
    """(seen, problem): whether the marker with ``token`` appeared within ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    problem = ""
    while True:
        try:
            with open(marker) as f:
                if f.read() == token:
                    return True, ""
        except FileNotFoundError:
            pass
        except OSError as exc:  # e.g. no permission to read the folder: worth naming if it lasts
            problem = f"cannot read it ({exc.strerror or exc})"
        if time.monotonic() >= deadline:
            return False, problem
        time.sleep(poll_s)


def _not_shared_message(writer: Sighting, blind: list[Sighting], timeout_s: float) -> str:
    groups: dict[tuple[str, str, str], list[int]] = {}
    for s in blind:
        groups.setdefault((s.host, s.output_dir, s.problem), []).append(s.rank)
    who = "; ".join(f"{_ranks(ranks)} on {host}{_details(folder, problem, writer.output_dir)}"
                    for (host, folder, problem), ranks in groups.items())
    return (f"train.output_dir is not one folder shared by all nodes: {who} did not see the marker that "
            f"rank 0 on {writer.host} wrote in {writer.output_dir} within {timeout_s:g} s "
            f"(train.shared_fs_timeout_s). Checkpoints need a filesystem shared by all nodes: set "
            f"train.output_dir to a path every node mounts (NFS, Lustre, ...), the same on every node.")


def _details(folder: str, problem: str, writer_folder: str) -> str:
    """`` (its train.output_dir is /b, cannot create it (...))``, or "" when there is nothing to add."""
    details = [f"its train.output_dir is {folder}"] if folder != writer_folder else []
    details += [problem] if problem else []
    return f" ({', '.join(details)})" if details else ""


def _ranks(ranks: list[int]) -> str:
    """``rank 3`` or ``ranks 8-15, 17``."""
    spans: list[list[int]] = []
    for r in sorted(ranks):
        if spans and r == spans[-1][1] + 1:
            spans[-1][1] = r
        else:
            spans.append([r, r])
    text = ", ".join(str(a) if a == b else f"{a}-{b}" for a, b in spans)
    return f"rank {text}" if len(ranks) == 1 else f"ranks {text}"
