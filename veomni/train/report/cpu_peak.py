"""The CPU's peak FLOP/s for MFU, measured once per machine and reused.

A CPU has no spec-sheet figure the engine could look up, so its peak is measured: the best of
many fp32 matmuls with the process's threads. Measured at every start-up, on a shared machine,
the figure moved 2.5x between runs (other jobs, turbo, cache state), so two runs' MFU could not
be compared. The first measurement on a machine is therefore kept in a small JSON file
(``$VEOMNI_CACHE_DIR``, default ``~/.cache/veomni``), keyed by the CPU model, the thread count
and the torch version, and every later run on that machine divides by the same figure. Delete
the file (its path is in the summary) to measure again, e.g. on an idle machine.
"""

from __future__ import annotations

import json
import os
import platform
import time
from pathlib import Path

import torch

CACHE_ENV = "VEOMNI_CACHE_DIR"
CACHE_FILE = "cpu_peak_flops.json"


def cache_path() -> Path:
    return Path(os.environ.get(CACHE_ENV) or Path.home() / ".cache" / "veomni") / CACHE_FILE


def cpu_model() -> str:
    """The CPU's model name (``/proc/cpuinfo`` on Linux), else what ``platform`` knows."""
    cpuinfo = Path("/proc/cpuinfo")
    if cpuinfo.is_file():
        for line in cpuinfo.read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    return platform.processor() or platform.machine()


def machine_key(threads: int) -> str:
    return f"{cpu_model()} | {threads} thread(s) | torch {torch.__version__}"


def measure_cpu_peak_flops(size: int = 1024, repeats: int = 16) -> float:
    """FLOP/s of the fastest of ``repeats`` fp32 ``size``-square matmuls (after one warm-up)."""
    a = torch.randn(size, size)
    b = torch.randn(size, size)
    torch.mm(a, b)
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        torch.mm(a, b)
        best = min(best, time.perf_counter() - start)
    return 2 * size**3 / best


def cached_cpu_peak_flops() -> tuple[float, str]:
    """(peak FLOP/s, where it came from): the machine's cached figure, or a new measurement that
    is cached for the next runs (written atomically: ranks measuring at once each publish a whole
    file)."""
    threads = torch.get_num_threads()
    key, path = machine_key(threads), cache_path()
    try:
        known = json.loads(path.read_text())
    except (OSError, ValueError):
        known = {}
    if key in known:
        peak = float(known[key]["flops"])
        return peak, (f"CPU fp32 matmul peak {peak / 1e9:.1f} GFLOP/s with {threads} thread(s), measured "
                      f"{known[key]['measured']} and cached in {path}")
    peak = measure_cpu_peak_flops()
    known[key] = {"flops": peak, "measured": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())}
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        partial = path.with_name(f"{path.name}.{os.getpid()}")
        partial.write_text(json.dumps(known, indent=2) + "\n")
        partial.replace(path)
        where = f"now cached in {path}"
    except OSError as exc:
        where = f"not cached ({exc}): later runs measure again"
    return peak, f"CPU fp32 matmul peak {peak / 1e9:.1f} GFLOP/s with {threads} thread(s), measured now, {where}"
