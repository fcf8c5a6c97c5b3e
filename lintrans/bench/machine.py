"""What a result was measured on: CPU model, threads, torch version, device, and the matmul peak."""
from __future__ import annotations

import os
import platform
import time
from pathlib import Path
from typing import Optional

import torch

from lintrans._platform import cpu_model, cpu_vector_features


def _thp_mode() -> str:
    try:
        text = Path("/sys/kernel/mm/transparent_hugepage/enabled").read_text()
    except OSError:
        return "n/a"
    return text[text.index("[") + 1 : text.index("]")] if "[" in text else text.strip()


def _native_kernels() -> bool:
    from lintrans.ops import native

    return native.active()


def machine_info(device: str = "cpu") -> dict:
    info = {
        "cpu": cpu_model(),
        # the vector extensions (avx2, avx512f, ...): figures from CPUs that differ here are not comparable
        "cpu_features": cpu_vector_features(),
        "cpu_count": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "torch": torch.__version__,
        "python": platform.python_version(),
        "platform": platform.platform(),
        "device": device,
        # PyTorch's huge-page allocation (set by the lintrans CLI) and the kernel's THP mode
        "thp_alloc": os.environ.get("THP_MEM_ALLOC_ENABLE", "0"),
        "transparent_hugepage": _thp_mode(),
        # whether the fused CPU kernels (lintrans/ops/native) ran, or the PyTorch path
        "native_kernels": _native_kernels(),
    }
    if device.startswith("cuda") and torch.cuda.is_available():
        info["gpu"] = torch.cuda.get_device_name(torch.device(device))
    return info


def synchronize(device) -> None:
    """Wait for ``device``'s queued work (a no-op on the CPU): what a wall-clock timing of GPU work needs."""
    device = torch.device(device)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    elif device.type == "mps":
        torch.mps.synchronize()


def _matmul_times(n: int, dtype: torch.dtype, device: str, seconds: float, min_reps: int) -> list[float]:
    """Seconds of an n-square matmul, repeated for ``seconds`` (at least ``min_reps`` times), sorted."""
    a = torch.randn(n, n, dtype=dtype, device=device)
    b = torch.randn(n, n, dtype=dtype, device=device)
    a @ b  # warm-up: thread pool, caches
    synchronize(device)
    times = []
    deadline = time.perf_counter() + seconds
    while len(times) < min_reps or time.perf_counter() < deadline:
        t0 = time.perf_counter()
        a @ b
        synchronize(device)
        times.append(time.perf_counter() - t0)
    return sorted(times)


def matmul_probe(seconds: float = 1.0, n: Optional[int] = None, device: str = "cpu") -> dict:
    """How fast the machine ran matmuls just now: a shared machine's speed drifts within
    a minute and differs from day to day (docs/benchmarks.md), so each record carries the speed it ran at.
    GFLOP/s of an n-square float32 matmul, best and median over ``seconds``, and max/min time.
    n defaults to 1024 on the CPU and 4096 on a GPU, where a 1024-square product is so short that
    launch and synchronisation jitter alone spread its times widely (docs/gpu.md)."""
    if n is None:
        n = 1024 if device == "cpu" else 4096
    times = _matmul_times(n, torch.float32, device, seconds, min_reps=3)
    flop = 2 * n**3 / 1e9
    def gflops(t: float) -> float:  # 3 significant digits: never rounded to 0 on a tiny or stalled probe
        return float(f"{flop / t:.3g}")

    return {"matmul_gflops_best": gflops(times[0]), "matmul_gflops_median": gflops(times[len(times) // 2]),
            "matmul_slowest_over_fastest": round(times[-1] / times[0], 2)}


def matmul_peak_flops(n: int = 2048, dtype: torch.dtype = torch.float32, device: str = "cpu",
                      seconds: float = 1.0) -> float:
    """Measured FLOP/s of one big square matmul (the practical peak that MFU is relative to)."""
    return 2 * n**3 / _matmul_times(n, dtype, device, seconds, min_reps=2)[0]
