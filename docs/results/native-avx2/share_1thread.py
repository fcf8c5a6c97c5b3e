"""The chunked op's share of the matmul probe as `lintrans cost --measure-op` computes it (the op's
FLOPs as the cost model counts them, over its time, against a 1024-square float32 matmul), but with
one thread and process CPU time for both: on a machine shared with other jobs, wall time measures
the neighbours, while one thread's CPU time is the work itself. Fastest of --repeats for each, the
two interleaved. One JSON line on stdout. The build is whatever LINTRANS_NATIVE_MARCH selects, torch's
MKL path whatever MKL_ENABLE_INSTRUCTIONS says (run.py runs it both ways)."""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[3]))

import torch  # noqa: E402

from lintrans.bench.cost import ModelShape, op_training_flops  # noqa: E402
from lintrans.bench.ops import make_op_step  # noqa: E402
from lintrans.ops import linear_attention, native  # noqa: E402


def cpu_seconds(fn) -> float:
    t0 = time.process_time()
    fn()
    return time.process_time() - t0


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--T", type=int, nargs="+", default=[4096, 16384])
    p.add_argument("--repeats", type=int, default=7)
    p.add_argument("--library", default=None, help="a build of the kernels to use instead of lintrans's own")
    args = p.parse_args()
    if args.library:
        import ctypes

        native._lib, native._tried = ctypes.CDLL(str(Path(args.library).resolve())), True
    torch.set_num_threads(1)
    lin = ModelShape(n_layer=1, n_head=8, n_embd=512, attention="linear", form="chunked", chunk_size=64, feature_dim=64)
    a, b = torch.randn(1024, 1024), torch.randn(1024, 1024)
    probe = lambda: a @ b  # noqa: E731
    probe()
    out = {"march": native.march(), "library": args.library and Path(args.library).name, "mkl": os.environ.get("MKL_ENABLE_INSTRUCTIONS", "default"),
           "native_active": native.active(), "threads": 1, "repeats": args.repeats, "load_average": os.getloadavg()}
    for T in args.T:
        step = make_op_step(lambda q, k, v: linear_attention(q, k, v, form="chunked", chunk_size=64)[0], T)
        step()
        op_t, probe_t = [], []
        for _ in range(args.repeats):
            op_t.append(cpu_seconds(step))
            probe_t.append(min(cpu_seconds(probe) for _ in range(5)))
        op_gflops = op_training_flops(lin, T) / min(op_t) / 1e9
        probe_gflops = 2 * 1024 ** 3 / min(probe_t) / 1e9
        out[f"T={T}"] = {"op_cpu_ms_min": round(min(op_t) * 1e3, 1), "op_gflops": round(op_gflops, 2),
                         "probe_gflops": round(probe_gflops, 1), "share_pct": round(100 * op_gflops / probe_gflops, 1)}
    print(json.dumps(out))


if __name__ == "__main__":
    main()
