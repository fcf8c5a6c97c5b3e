"""A small randomly initialised Qwen3-Next model in transformers, on a CPU: prefill of T tokens and per-token
decoding through the cache, with transformers' own Gated DeltaNet fallback and with lintrans' delta rule
(``lintrans.interop.transformers.patch_qwen3_next``), side by side in one process.

    .venv/bin/python docs/results/qwen3-next-dropin/measure.py [--T 4096] [--repeats 5] [--decode 16]

Writes record.json and record.png beside this file. Run it in a plain Python process (default threads).
The two alternate within each repeat, so a load that drifts touches both; the figures are medians.
"""
from __future__ import annotations

import argparse
import functools
import json
import os
import statistics
import subprocess
import time
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent


def config(args):
    from transformers import Qwen3NextConfig

    # Qwen3-Next's layer pattern (three Gated DeltaNet layers, then one full-attention layer) and its
    # Gated DeltaNet head sizes (Dk = Dv = 128, two value heads per key head), at a width a 2-core CPU runs
    return Qwen3NextConfig(
        vocab_size=1024, hidden_size=args.hidden, intermediate_size=2 * args.hidden, num_hidden_layers=4,
        num_attention_heads=4, num_key_value_heads=2, head_dim=128, linear_conv_kernel_dim=4,
        linear_key_head_dim=128, linear_value_head_dim=128, linear_num_key_heads=args.k_heads,
        linear_num_value_heads=2 * args.k_heads, num_experts=8, num_experts_per_tok=2,
        moe_intermediate_size=args.hidden // 2, shared_expert_intermediate_size=args.hidden // 2,
        max_position_embeddings=2 * args.T,
        layer_types=["linear_attention", "linear_attention", "linear_attention", "full_attention"],
    )


class OpClock:
    """Seconds spent inside the Gated DeltaNet functions the layers call (whichever they are)."""

    def __init__(self):
        self.seconds = 0.0

    def wrap(self, fn):
        @functools.wraps(fn)
        def timed(*args, **kwargs):
            t0 = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                self.seconds += time.perf_counter() - t0

        return timed


def run_once(model, ids, n_decode, clock):
    """(prefill s, of which in the delta rule s, per-token decode s, of which in the delta rule s, prefill
    logits, decoded logits)."""
    with torch.no_grad():
        clock.seconds = 0.0
        t0 = time.perf_counter()
        out = model(ids, use_cache=True)
        prefill, prefill_op = time.perf_counter() - t0, clock.seconds
        cache, logits = out.cache, out.logits
        token = logits[:, -1:].argmax(-1)
        steps, step_ops, decoded = [], [], []
        for _ in range(n_decode):
            clock.seconds = 0.0
            t0 = time.perf_counter()
            out = model(token, cache=cache, use_cache=True)
            steps.append(time.perf_counter() - t0)
            step_ops.append(clock.seconds)
            cache = out.cache
            decoded.append(out.logits)
            token = out.logits[:, -1:].argmax(-1)
    i = steps.index(statistics.median_low(steps))
    return prefill, prefill_op, steps[i], step_ops[i], logits, torch.cat(decoded, dim=1)


def decode_step_op(cfg, hf_fn, our_fn, n: int) -> dict:
    """The delta rule alone for one decoding token at the model's shapes (a state of T tokens' worth is
    just a [B, Hv, Dk, Dv] tensor): each function n times, alternating; median and 10th percentile."""
    g = torch.Generator().manual_seed(2)
    hk, hv, dk, dv = (cfg.linear_num_key_heads, cfg.linear_num_value_heads, cfg.linear_key_head_dim,
                      cfg.linear_value_head_dim)
    q, k = (torch.randn(1, 1, hk, dk, generator=g) for _ in range(2))
    v = torch.randn(1, 1, hv, dv, generator=g)
    beta, ld = torch.rand(1, 1, hv, generator=g), -torch.rand(1, 1, hv, generator=g)
    S = torch.randn(1, hv, dk, dv, generator=g) * 0.1
    out = {"transformers": [], "lintrans": []}
    with torch.no_grad():
        for i in range(n + 10):
            for name, fn in (("transformers", hf_fn), ("lintrans", our_fn)):
                t0 = time.perf_counter()
                fn(q, k, v, g=ld, beta=beta, initial_state=S, output_final_state=True, use_qk_l2norm_in_kernel=True)
                if i >= 10:
                    out[name].append(time.perf_counter() - t0)

    def summary(xs):
        xs = sorted(xs)
        return {"median_s": statistics.median(xs), "p10_s": xs[len(xs) // 10], "calls": len(xs)}

    return {name: summary(xs) for name, xs in out.items()}


def git_state() -> dict:
    def git(*a):
        try:
            return subprocess.run(["git", *a], cwd=HERE, capture_output=True, text=True, timeout=30).stdout.strip()
        except OSError:
            return ""

    return {"commit": git("rev-parse", "HEAD"),
            "uncommitted_in_lintrans_ops": git("status", "--porcelain", "--", "../../../lintrans/ops").splitlines()}


def plot(record, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = ["transformers", "lintrans"]
    labels = ["transformers\nfallback", "lintrans\ndelta_rule"]
    fig, axes = plt.subplots(1, 2, figsize=(9, 4))
    for ax, key, op_key, label, scale in (
            (axes[0], "prefill_s", "prefill_in_delta_rule_s", f"prefill, T = {record['setup']['T']} (s)", 1.0),
            (axes[1], "decode_per_token_s", "decode_in_delta_rule_s", "decode, per token (ms)", 1e3)):
        total = [record["results"][n][key] * scale for n in names]
        op = [record["results"][n][op_key] * scale for n in names]
        ax.bar(labels, op, color="#1f77b4", label="in the delta rule")
        bars = ax.bar(labels, [t - o for t, o in zip(total, op)], bottom=op, color="#bbbbbb",
                      label="rest of the model")
        ax.bar_label(bars, labels=[f"{t:.3g}" for t in total])
        ax.set_title(label, fontsize=10)
    axes[0].legend(fontsize=8)
    m = record["machine"]
    features = m["cpu_features"] if isinstance(m["cpu_features"], str) else " ".join(m["cpu_features"])
    fig.suptitle(f"Qwen3-Next (small, random) on CPU: {m['cpu']} ({features}), "
                 f"{m['torch_threads']} threads; medians of {record['setup']['repeats']}", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--T", type=int, default=4096, help="prefill length")
    p.add_argument("--decode", type=int, default=16, help="tokens decoded after the prefill, each timed")
    p.add_argument("--repeats", type=int, default=5, help="prefill+decode runs per implementation")
    p.add_argument("--hidden", type=int, default=512)
    p.add_argument("--k-heads", type=int, default=4, help="Gated DeltaNet key heads (value heads: twice)")
    p.add_argument("--step-calls", type=int, default=300, help="calls of each one-token delta rule, alone")
    p.add_argument("--out", type=Path, default=HERE)
    args = p.parse_args()

    from transformers import Qwen3NextForCausalLM
    from transformers.utils import logging as hf_logging

    from lintrans.bench.machine import machine_info
    from lintrans.interop.transformers import patch_qwen3_next, unpatch_qwen3_next

    hf_logging.set_verbosity_error()  # the fallback's "install fla" notice, once per function
    from transformers.models.qwen3_next import modeling_qwen3_next as hf_module

    import lintrans.interop.transformers as interop

    # both sides' delta-rule functions timed: transformers' in its module, ours before the patch takes them
    clock = OpClock()
    for module, names in ((hf_module, ("torch_chunk_gated_delta_rule", "torch_recurrent_gated_delta_rule")),
                          (interop, ("chunk_gated_delta_rule", "recurrent_gated_delta_rule"))):
        for name in names:
            setattr(module, name, clock.wrap(getattr(module, name)))
    torch.manual_seed(0)
    cfg = config(args)
    model = Qwen3NextForCausalLM(cfg).eval()
    ids = torch.randint(0, cfg.vocab_size, (1, args.T), generator=torch.Generator().manual_seed(1))
    load_before = os.getloadavg()
    keys = ("prefill", "prefill_op", "decode", "decode_op")
    times = {name: {k: [] for k in keys} for name in ("transformers", "lintrans")}
    logits = {}
    for rep in range(args.repeats + 1):  # the first round warms up (the kernels' build, caches) and is dropped
        order = ["transformers", "lintrans"] if rep % 2 else ["lintrans", "transformers"]
        for name in order:
            if name == "lintrans":
                patch_qwen3_next(model)
            *measured, lg, dec = run_once(model, ids, args.decode, clock)
            unpatch_qwen3_next(model)
            if rep:
                for k, x in zip(keys, measured):
                    times[name][k].append(x)
            logits[name] = (lg, dec)
            print(f"round {rep} {name}: prefill {measured[0]:.3f} s (delta rule {measured[1]:.3f} s), decode "
                  f"{1e3 * measured[2]:.2f} ms/token (delta rule {1e3 * measured[3]:.2f} ms)", flush=True)
    step = decode_step_op(cfg, hf_module.torch_recurrent_gated_delta_rule, interop.recurrent_gated_delta_rule,
                          args.step_calls)
    print("one decoding token, the delta rule alone:", json.dumps(step), flush=True)
    load_after = os.getloadavg()
    diff_prefill = (logits["lintrans"][0] - logits["transformers"][0]).abs().max().item()
    diff_decode = (logits["lintrans"][1] - logits["transformers"][1]).abs().max().item()
    results = {}
    for n, t in times.items():
        results[n] = {
            "prefill_s": statistics.median(t["prefill"]), "prefill_runs_s": t["prefill"],
            "prefill_in_delta_rule_s": statistics.median(t["prefill_op"]),
            "prefill_in_delta_rule_runs_s": t["prefill_op"],
            "decode_per_token_s": statistics.median(t["decode"]), "decode_per_token_runs_s": t["decode"],
            "decode_in_delta_rule_s": statistics.median(t["decode_op"]), "decode_in_delta_rule_runs_s": t["decode_op"],
        }
    record = {
        "benchmark": "qwen3-next-dropin",
        "title": f"Qwen3-Next (small, randomly initialised) in transformers on a CPU: prefill of {args.T} tokens "
                 f"and per-token decoding, transformers' Gated DeltaNet fallback against lintrans' delta_rule",
        "machine": machine_info("cpu"),
        "load_average_before_after": [load_before, load_after],
        "shared_machine_note": "measured on a shared, busy machine (other jobs running; see the load averages): "
                               "medians of alternating runs; the ratio is the figure to read, not the seconds",
        "setup": {"T": args.T, "batch": 1, "repeats": args.repeats, "decode_tokens": args.decode,
                  "dtype": "float32", "mode": "torch.no_grad, use_cache=True",
                  "model": {k: getattr(cfg, k) for k in (
                      "hidden_size", "num_hidden_layers", "layer_types", "linear_num_key_heads",
                      "linear_num_value_heads", "linear_key_head_dim", "linear_value_head_dim", "num_attention_heads",
                      "head_dim", "num_experts", "num_experts_per_tok", "vocab_size")},
                  "parameters": sum(p.numel() for p in model.parameters())},
        "versions": {"transformers": __import__("transformers").__version__, **git_state()},
        "results": results,
        "decode_step_delta_rule_alone": step,
        "speedup": {key: results["transformers"][key] / results["lintrans"][key] for key in (
            "prefill_s", "prefill_in_delta_rule_s", "decode_per_token_s", "decode_in_delta_rule_s")}
        | {"decode_step_delta_rule_alone": step["transformers"]["median_s"] / step["lintrans"]["median_s"]},
        "how": "each repeat runs a prefill (use_cache=True) then decodes --decode greedy tokens one at a time; "
               "a repeat's decode figure is its median token; *_in_delta_rule_* is the time spent inside the "
               "layers' delta-rule functions (transformers' fallback or ours) during that prefill or token; "
               "decode_step_delta_rule_alone: the one-token functions called alone at the model's shapes",
        "max_abs_logit_difference": {"prefill": diff_prefill, "decode": diff_decode,
                                     "max_abs_logit": logits["transformers"][0].abs().max().item()},
        "script": "docs/results/qwen3-next-dropin/measure.py",
    }
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "record.json").write_text(json.dumps(record, indent=1) + "\n")
    plot(record, args.out / "record.png")
    print(json.dumps(record["speedup"]), json.dumps(record["max_abs_logit_difference"]))


if __name__ == "__main__":
    main()
