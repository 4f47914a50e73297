"""What the figures were measured on, and the machine's own matmul peak for the MFU figure."""

from __future__ import annotations

import os
import platform
import statistics
import time

import torch


def cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def machine_info(dtype: str) -> dict:
    """Recorded beside every result; the load average says how busy a shared machine was."""
    return {
        "cpu": cpu_model(),
        "cores": os.cpu_count(),
        "torch": torch.__version__,
        "torch_threads": torch.get_num_threads(),
        "dtype": dtype,
        "python": platform.python_version(),
        "load_average_1m": round(os.getloadavg()[0], 2),
        "time": time.strftime("%Y-%m-%d %H:%M:%S %z"),
    }


def peak_matmul_flops(dtype: str, n: int = 2048, repeats: int = 5) -> float:
    """FLOP/s of an n x n x n matmul in dtype, median of `repeats` after one warm-up."""
    a = torch.randn(n, n, dtype=getattr(torch, dtype))
    b = torch.randn(n, n, dtype=getattr(torch, dtype))
    torch.mm(a, b)
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        torch.mm(a, b)
        times.append(time.perf_counter() - t0)
    return 2 * n**3 / statistics.median(times)


def set_threads(threads: int) -> None:
    """The same torch thread count here and in every worker process started from here."""
    os.environ["OMP_NUM_THREADS"] = str(threads)
    torch.set_num_threads(threads)
