"""Throughput, MFU and memory.

MFU = achieved model FLOPs per second per device / the device's peak. On GPUs the peak is the
dense bf16 figure of the device (table below); on CPU it is measured once per machine and
cached (``cpu_peak.py``), so runs on one machine divide by the same figure; the summary says which.
"""

from __future__ import annotations

import logging
import resource
import time

import torch

from veomni.train.report.cpu_peak import cached_cpu_peak_flops

logger = logging.getLogger(__name__)

GPU_PEAK_BF16_FLOPS = {
    "H200": 989e12,
    "H100": 989e12,
    "H800": 989e12,
    "H20": 148e12,
    "A100": 312e12,
    "A800": 312e12,
    "L40": 181e12,
    "L20": 119.5e12,
    "B200": 2250e12,
    "GB200": 2500e12,
}


def device_peak_flops(device: torch.device) -> tuple[float, str]:
    """(peak FLOP/s, how it was obtained) for one device."""
    if device.type == "cuda":
        name = torch.cuda.get_device_name(device)
        for key, peak in GPU_PEAK_BF16_FLOPS.items():
            if key in name:
                return peak, f"{name}: dense bf16 peak {peak / 1e12:.0f} TFLOP/s from the spec table"
        logger.warning("unknown GPU %r: MFU will be reported as 0", name)
        return float("inf"), f"{name}: not in the peak table"
    return cached_cpu_peak_flops()


def peak_memory_gb(device: torch.device) -> float:
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**30
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20  # KiB on Linux


class StepTimer:
    def __init__(self) -> None:
        self.start = time.perf_counter()

    def lap(self) -> float:
        now = time.perf_counter()
        elapsed, self.start = now - self.start, now
        return elapsed
