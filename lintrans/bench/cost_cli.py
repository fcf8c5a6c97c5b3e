"""`lintrans cost`: parameters, FLOPs per component, where attention overtakes the rest, KV cache
against recurrent state, arithmetic intensity and (given a measured step time) MFU."""
from __future__ import annotations

import argparse
import math
import sys

from lintrans.checks import check_choice, check_positive_int

from .cost import (
    ModelShape, arithmetic_intensity, attention_crossover, cache_bytes, forward_flops, mfu, op_training_flops,
    parameters, speedup_bounds, training_flops,
)
from .sizes import ALIASES, SIZES, VOCAB, feature_dim_of, model_size


def configure(p: argparse.ArgumentParser) -> None:
    p.add_argument("--size", default=None, help=f"a benchmark model size, one of {list(SIZES)}, or another name of one "
                   f"({', '.join(n for n in ALIASES if ' ' not in n)}: GPT-2 124M, the shipped config gpt2-124m); "
                   "sets the next three")
    p.add_argument("--n-layer", type=int, default=None, help="transformer blocks (default 12, GPT-2 124M's)")
    p.add_argument("--n-head", type=int, default=None, help="attention heads (default 12)")
    p.add_argument("--n-embd", type=int, default=None, help="model width (default 768)")
    p.add_argument("--n-kv-head", type=int, default=None, help="key/value heads, grouped-query (default --n-head)")
    p.add_argument("--vocab", type=int, default=VOCAB, help=f"vocabulary size (default {VOCAB})")
    p.add_argument("--block-size", type=int, default=1024,
                   help="learned positions the model has (GPT-2: 1024); longer --T only adds their count separately")
    p.add_argument("--mlp", choices=["gelu", "swiglu"], default="gelu", help="the feed-forward block (default gelu)")
    p.add_argument("--T", type=int, nargs="+", default=[1024, 4096, 16384],
                   help="context lengths (default 1024 4096 16384)")
    p.add_argument("--batch", type=int, default=1, help="sequences per step (default 1)")
    p.add_argument("--form", default="chunked", help="linear form for the linear columns (default chunked)")
    p.add_argument("--chunk-size", type=int, default=64, help="chunk of the chunked form (default 64)")
    p.add_argument("--feature-map", default="elu", help="sets the feature dimension F (default elu: F = head dim)")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"],
                   help="bytes per cached number (default float32)")
    p.add_argument("--step-time", type=float, nargs="+", default=None,
                   help="measured seconds per training step, one per --T (softmax model): prints MFU")
    p.add_argument("--linear-step-time", type=float, nargs="+", default=None, help="the same for the linear model")
    p.add_argument("--peak-tflops", type=float, default=None,
                   help="the peak to compute MFU against, instead of measuring the matmul peak for it")
    op = p.add_mutually_exclusive_group()
    op.add_argument("--op-time", type=float, nargs="+", default=None,
                    help="measured seconds of the linear attention op, forward + backward on [batch, T, n-head, "
                         "head dim], one per --T: prints its share of the matmul probe")
    op.add_argument("--measure-op", action="store_true",
                    help="time that op here (fastest of --op-repeats) and the matmul probe beside it")
    p.add_argument("--op-repeats", type=int, default=None, help="timed repeats of the op with --measure-op (default 5)")
    p.add_argument("--probe-gflops", type=float, default=None,
                   help="the matmul probe's GFLOP/s (1024-square float32, as `lintrans bench` records it) "
                        "to divide by, instead of measuring it in this run")


def _g(x: float) -> str:
    for unit, f in (("P", 1e15), ("T", 1e12), ("G", 1e9), ("M", 1e6), ("k", 1e3)):
        if abs(x) >= f:
            return f"{x / f:.2f}{unit}"
    return f"{x:.2f}"


def _b(n: float) -> str:
    for unit, f in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= f:
            return f"{n / f:.1f} {unit}"
    return f"{n:.0f} B"


def _check(args) -> None:
    """ValueError naming the first bad flag."""
    shape = ("n_layer", "n_head", "n_embd")
    given = [f"--{f.replace('_', '-')}" for f in shape if getattr(args, f) is not None]
    if args.size and given:
        raise ValueError(f"--size sets --n-layer, --n-head and --n-embd; give either it or {', '.join(given)}")
    size = model_size(args.size or "gpt2-124m")  # unset flags: GPT-2 124M's
    for flag in shape:
        if getattr(args, flag) is None:
            setattr(args, flag, getattr(size, flag))
    for flag in ("n_layer", "n_head", "n_embd", "vocab", "block_size", "batch", "chunk_size"):
        check_positive_int(f"--{flag.replace('_', '-')}", getattr(args, flag))
    check_positive_int("--op-repeats", args.op_repeats, allow_none=True)
    if args.n_embd % args.n_head:
        raise ValueError(f"--n-embd ({args.n_embd}) must be divisible by --n-head ({args.n_head})")
    check_positive_int("--n-kv-head", args.n_kv_head, allow_none=True)
    if args.n_kv_head is not None and args.n_head % args.n_kv_head:
        raise ValueError(f"--n-kv-head must divide --n-head ({args.n_head}), got {args.n_kv_head}")
    for T in args.T:
        check_positive_int("every --T", T)
    from lintrans.ops.linear.forms import FORMS  # torch: the cost columns import the layers anyway

    check_choice("--form", args.form, list(FORMS))
    for flag in ("step_time", "linear_step_time", "op_time"):
        times = getattr(args, flag)
        if times is None:
            continue
        if len(times) != len(args.T):
            raise ValueError(f"--{flag.replace('_', '-')} needs one time per --T ({len(args.T)}), got {len(times)}")
        if not all(math.isfinite(t) and t > 0 for t in times):
            raise ValueError(f"--{flag.replace('_', '-')} must be positive seconds, got {times}")
    for flag in ("peak_tflops", "probe_gflops"):
        value = getattr(args, flag)
        if value is not None and not (math.isfinite(value) and value > 0):
            raise ValueError(f"--{flag.replace('_', '-')} must be positive, got {value}")
    # flags that only feed another one's report: refused without it, not silently unused
    needs = (("peak_tflops", ("step_time", "linear_step_time")), ("probe_gflops", ("op_time", "measure_op")),
             ("op_repeats", ("measure_op",)))
    for flag, users in needs:
        if getattr(args, flag) is not None and not any(getattr(args, u) for u in users):
            names = " or ".join(f"--{u.replace('_', '-')}" for u in users)
            raise ValueError(f"--{flag.replace('_', '-')} is used only with {names}, which is not given")
    if args.op_repeats is None:
        args.op_repeats = 5


def run(args) -> int:
    try:
        _check(args)
        try:
            F = feature_dim_of(args.feature_map, args.n_embd // args.n_head)
        except (ValueError, TypeError) as e:
            raise type(e)(f"--feature-map: {e}") from None
    except (ValueError, TypeError) as e:
        print(f"lintrans cost: {e}", file=sys.stderr)
        return 2
    common = dict(n_layer=args.n_layer, n_head=args.n_head, n_embd=args.n_embd, vocab_size=args.vocab,
                  block_size=args.block_size, n_kv_head=args.n_kv_head, mlp=args.mlp)
    soft = ModelShape(**common, attention="softmax")
    lin = ModelShape(**common, attention="linear", form=args.form, chunk_size=args.chunk_size,
                     feature_dim=F)
    print(f"model: L={args.n_layer} N={args.n_head} D={args.n_embd} h={soft.head_dim} V={args.vocab} "
          f"mlp={args.mlp}; linear: {args.form}, c={args.chunk_size}, {args.feature_map} (F={lin.F}); B={args.batch}")
    print("\nparameters:")
    for k, v in parameters(soft).items():
        print(f"  {k:<24}{v:>14,}")
    longest = max(args.T)
    if longest > args.block_size:
        print(f"  (learned positions for T = {longest} would add {(longest - args.block_size) * args.n_embd:,} "
              f"parameters to the {args.block_size} the model has)")
    B = args.batch
    for T in args.T:
        fs, fl = training_flops(soft, T, B), training_flops(lin, T, B)
        print(f"\ntraining FLOPs per step at T = {T} (forward + backward = 3x forward):")
        print(f"  {'component':<22}{'softmax':>12}{'linear':>12}")
        for k in fs:
            print(f"  {k:<22}{_g(fs[k]):>12}{_g(fl[k]):>12}")
        bound = speedup_bounds(soft, lin, T, B)
        print(f"  FLOP ratio softmax / linear: {bound['dense']:.2f}x counting the full T^2, {bound['causal']:.2f}x "
              "counting the causal half (what SDPA computes)")
        print(f"  with no attention at all the step would have {bound['no_mixing']:.2f}x fewer FLOPs than softmax: "
              "no mechanism can gain more (Amdahl)")
        inf_s, inf_l = forward_flops(soft, T, B)["total"], forward_flops(lin, T, B)["total"]
        print(f"  inference (forward) FLOPs: softmax {_g(inf_s)}, linear {_g(inf_l)}")
        cb, cl = cache_bytes(soft, T, B, args.dtype), cache_bytes(lin, T, B, args.dtype)
        print(f"  generation memory: KV cache {_b(cb)} ({args.dtype}), linear state {_b(cl)}")
        ai = arithmetic_intensity(lin, T, B, args.dtype)
        print("  arithmetic intensity (FLOPs/byte): " + ", ".join(f"{k} {v:.1f}" for k, v in ai.items()))
    cross = attention_crossover(soft)
    print(f"\nsoftmax attention FLOPs overtake all the other FLOPs at T = {cross}"
          + ("" if cross is None else f" ({cross / args.n_embd:.1f} x D)"))
    cross_l = attention_crossover(lin)
    print(f"linear ({args.form}) attention FLOPs overtake the rest at T = {cross_l if cross_l else 'never (linear in T)'}")
    if args.step_time or args.linear_step_time:
        if args.peak_tflops:
            peak, how = args.peak_tflops * 1e12, "passed in"
        else:
            from .machine import matmul_peak_flops

            peak, how = matmul_peak_flops(), "measured"
        print(f"\nmatmul peak (float32, {how}): {_g(peak)}FLOP/s")
        for name, shape, times in (("softmax", soft, args.step_time), ("linear", lin, args.linear_step_time)):
            for T, t in zip(args.T, times or []):
                tf = training_flops(shape, T, B)
                # softmax: the causal half of T^2 that the kernel (SDPA) computes, not the dense count
                f = tf["total"] - tf["attention"] / 2 if shape.attention == "softmax" else tf["total"]
                u = mfu(f, t, peak)
                print(f"  {name} T={T}: {_g(f / t)}FLOP/s achieved, MFU {100 * u:.1f}%"
                      + ("  <- above 100%: this step time cannot come from a machine with this peak (was it "
                         "measured elsewhere? pass that machine's --peak-tflops)" if u > 1 else ""))
    if args.op_time or args.measure_op:
        op_share(args, lin)
    return 0


def measure_op(args, T: int) -> float:
    """Seconds of the linear op, forward + backward on [batch, T, n-head, head dim], fastest of
    ``--op-repeats`` after a warm-up (other jobs on the machine only ever add time)."""
    from lintrans.ops import linear_attention

    from .measure import time_step
    from .ops import make_op_step

    def fn(q, k, v):
        return linear_attention(q, k, v, form=args.form, feature_map=args.feature_map, chunk_size=args.chunk_size)[0]

    step = make_op_step(fn, T, B=args.batch, H=args.n_head, D=args.n_embd // args.n_head)
    step()
    return min(time_step(step) for _ in range(args.op_repeats))


def op_share(args, lin: ModelShape) -> None:
    """The op's achieved FLOP/s (FLOPs as this model counts its form) as a share of the matmul probe,
    the probe passed in or measured in this run, right after the op."""
    import os

    from .machine import matmul_probe

    h = args.n_embd // args.n_head
    print(f"\nattention op, {args.form} ({args.feature_map}, c={args.chunk_size}), forward + backward on "
          f"[{args.batch}, T, {args.n_head}, {h}]"
          + (f" (measured here, THP_MEM_ALLOC_ENABLE={os.environ.get('THP_MEM_ALLOC_ENABLE', '0')})"
             if args.measure_op else "") + ":")
    times = args.op_time or [measure_op(args, T) for T in args.T]
    if args.probe_gflops:
        probe, where = args.probe_gflops * 1e9, "passed in"
    else:
        p = matmul_probe()
        probe, where = p["matmul_gflops_best"] * 1e9, f"measured now, best; median {p['matmul_gflops_median']:.0f}"
    print(f"  matmul probe (1024-square float32): {probe / 1e9:.0f} GFLOP/s ({where})")
    for T, t in zip(args.T, times):
        f = op_training_flops(lin, T, args.batch)
        share = mfu(f, t, probe)
        print(f"  T={T}: {_g(f)}FLOP in {t * 1e3:.1f} ms = {_g(f / t)}FLOP/s, {100 * share:.1f}% of the probe")
