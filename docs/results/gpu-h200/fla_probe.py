"""Why did ``linear_attention(backend="fla")``'s first call not return on the H100 (docs/gpu.md)?

Times fla's import and its first and second calls, one shape at a time, from the smallest kernel up to
the shapes of ``test_fla_kernels_match_ours_on_cuda`` (V = Dv + 1 = 49: our normaliser column), then
``chunk_gated_delta_rule``. faulthandler prints every thread's stack every DUMP seconds, so a call that
hangs shows where. TRITON_PRINT_AUTOTUNING=1 (set by run.sh) logs each autotuning Triton does.
Usage: python3 fla_probe.py [DUMP_SECONDS]"""
import faulthandler
import sys
import time

import torch

DUMP = float(sys.argv[1]) if len(sys.argv) > 1 else 30.0
faulthandler.dump_traceback_later(DUMP, repeat=True, file=sys.stderr)
t0 = time.perf_counter()


def say(*a):
    print(f"[{time.perf_counter() - t0:7.1f}s]", *a, flush=True)


def timed(what, fn):
    t = time.perf_counter()
    out = fn()
    torch.cuda.synchronize()
    say(f"{what}: {time.perf_counter() - t:.2f} s")
    return out


import fla  # noqa: E402
from fla.ops.gated_delta_rule import chunk_gated_delta_rule  # noqa: E402
from fla.ops.simple_gla import chunk_simple_gla  # noqa: E402

say("import fla", fla.__version__, "torch", torch.__version__, torch.cuda.get_device_name())


def simple(B, T, H, K, V, gate, backward):
    g = torch.Generator(device="cuda").manual_seed(0)
    q, k = (torch.randn(B, T, H, K, device="cuda", generator=g).requires_grad_() for _ in range(2))
    v = torch.randn(B, T, H, V, device="cuda", generator=g).requires_grad_()
    ld = -torch.rand(B, T, H, device="cuda", generator=g) * 0.1 if gate else None
    S0 = torch.randn(B, H, K, V, device="cuda", generator=g) * 0.1

    def run():
        o, S = chunk_simple_gla(q, k, v, ld, scale=K**-0.5, initial_state=S0, output_final_state=True)
        if backward:
            (o.square().sum() + S.sum()).backward()
    return run


for K, V, gate in [(64, 64, False), (32, 48, False), (32, 49, False), (32, 49, True)]:
    for bwd in (False, True):
        fn = simple(2, 64, 3, K, V, gate, bwd)
        timed(f"chunk_simple_gla K={K} V={V} gate={gate} backward={bwd}, first call", fn)
        timed(f"  second call", fn)

from lintrans.ops import linear_attention  # noqa: E402

for T in (1, 37):
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, T, 3, d, generator=g).cuda().requires_grad_() for d in (32, 32, 48))
    S0 = (torch.randn(2, 3, 32, 48, generator=g).cuda() * 0.1, torch.rand(2, 3, 32, generator=g).cuda() + 0.5)

    def run():
        o, (S, z) = linear_attention(q, k, v, backend="fla", scale=32**-0.5, initial_state=S0, output_final_state=True)
        (o.square().sum() + S.sum() + z.sum()).backward()
    timed(f"linear_attention(backend='fla') T={T} (the test's shape), first call", run)
    timed("  second call", run)

for T in (64, 100):
    g = torch.Generator(device="cuda").manual_seed(0)
    q, k, v = (torch.randn(2, T, 2, 64, device="cuda", generator=g).requires_grad_() for _ in range(3))
    beta = torch.rand(2, T, 2, device="cuda", generator=g).requires_grad_()
    ld = (-torch.rand(2, T, 2, device="cuda", generator=g)).requires_grad_()

    def run():
        o, S = chunk_gated_delta_rule(q, k, v, ld, beta, output_final_state=True, use_qk_l2norm_in_kernel=True)
        (o.square().sum() + S.sum()).backward()
    timed(f"chunk_gated_delta_rule T={T} D=64 fwd+bwd, first call", run)
    timed("  second call", run)
faulthandler.cancel_dump_traceback_later()
say("done")
