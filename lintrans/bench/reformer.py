"""Two Reformer measurements: how far LSH attention is from full shared-QK attention as the number
of hash rounds grows, and training memory against depth with and without reversible layers.

    python -m lintrans.bench.reformer error  --out DIR     # deterministic, any machine
    python -m lintrans.bench.reformer memory --out DIR     # peak memory (CUDA allocator or peak RSS)
"""
from __future__ import annotations

import argparse
import inspect
import json
import math
import sys
import time
from pathlib import Path

import torch


def error_inputs(kind: str, T: int, H: int, D: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """qk, v [1, T, H, D] in float64. ``random``: Gaussian qk scaled so that the scores
    scale * qk_i . k_j have standard deviation about 2 (a peaked softmax). ``clustered``: 32
    random directions, each token one of them plus noise (norm sqrt(D) * 8): attention falls on
    the token's cluster, the case LSH is built for."""
    g = torch.Generator().manual_seed(seed)
    v = torch.randn(1, T, H, D, generator=g, dtype=torch.float64)
    if kind == "random":
        return torch.randn(1, T, H, D, generator=g, dtype=torch.float64) * 16, v
    centres = torch.nn.functional.normalize(torch.randn(32, H, D, generator=g, dtype=torch.float64), dim=-1)
    which = torch.randint(0, 32, (T,), generator=g)
    x = centres[which] + 0.1 * torch.randn(T, H, D, generator=g, dtype=torch.float64) / math.sqrt(D)
    return (torch.nn.functional.normalize(x, dim=-1) * math.sqrt(D) * 8)[None], v


def lsh_error(T: int = 1024, H: int = 4, D: int = 64, chunk_size: int = 64, n_buckets: int = 32,
              hashes=(1, 2, 4, 8, 16), seeds=(0, 1, 2)) -> list[dict]:
    """Relative error ||o_lsh - o_full|| / ||o_full|| (causal) per input kind, lookback and
    n_hashes, averaged over the rotation seeds, and the share of full attention's weight that the
    allowed keys hold (its attention mass on the LSH mask)."""
    from lintrans.ops.lsh import lsh_attention, lsh_buckets, lsh_mask, shared_qk_attention

    rows = []
    for kind in ("random", "clustered"):
        qk, v = error_inputs(kind, T, H, D, seed=123)
        full = shared_qk_attention(qk, v, causal=True)
        # full attention's weights, for the mass the mask keeps
        probs = shared_qk_attention(qk, torch.eye(T, dtype=torch.float64)[None, :, None].expand(1, T, H, T),
                                    causal=True).permute(0, 2, 1, 3)  # [1,H,T,T]
        for lookback in ("window", "chunk"):
            for r in hashes:
                errs, mass, keys = [], [], []
                for seed in seeds:
                    kw = dict(n_buckets=n_buckets, n_hashes=r, chunk_size=chunk_size, causal=True, seed=seed)
                    o, _ = lsh_attention(qk, v, lookback=lookback, **kw)
                    errs.append(float((o - full).norm() / full.norm()))
                    m = lsh_mask(lsh_buckets(qk, n_buckets=n_buckets, n_hashes=r, seed=seed),
                                 chunk_size=chunk_size, causal=True, lookback=lookback)
                    mass.append(float((probs * m).sum(-1).mean()))
                    keys.append(float(m.sum(-1).float().mean()))
                rows.append(dict(input=kind, lookback=lookback, n_hashes=r, rel_error=sum(errs) / len(errs),
                                 rel_error_min=min(errs), rel_error_max=max(errs),
                                 attention_mass_kept=sum(mass) / len(mass), keys_per_query=sum(keys) / len(keys)))
                print(f"{kind:9s} {lookback:6s} hashes {r:2d}: rel error {rows[-1]['rel_error']:.4f} "
                      f"(seeds {min(errs):.4f}-{max(errs):.4f}), mass kept {rows[-1]['attention_mass_kept']:.3f}, "
                      f"keys/query {rows[-1]['keys_per_query']:.1f}", flush=True)
    return rows


MEMORY_VOCAB = 512  # the memory GPTs' vocabulary: small, so that the blocks dominate the peak


def reversible_memory(device: str, layers=(2, 4, 8, 16), attentions=("softmax", "reformer"), T: int = 1024,
                      B: int = 1, n_embd: int = 128, n_head: int = 4) -> list[dict]:
    """Peak memory and time of one training step (forward + backward) of a GPT against depth,
    ordinary and reversible."""
    from lintrans.models import GPT, GPTConfig

    from .measure import peak_memory
    from .machine import synchronize

    rows = []
    for attention in attentions:
        for n_layer in layers:
            for rev in (False, True):
                cfg = GPTConfig(n_layer=n_layer, n_head=n_head, n_embd=n_embd, block_size=T, vocab_size=MEMORY_VOCAB,
                                attention=attention, reversible=rev, dropout=0.0)
                torch.manual_seed(0)
                model = GPT(cfg).to(device)
                idx = torch.randint(0, MEMORY_VOCAB, (B, T), device=device)

                def step():  # gradient buffers kept: the peak is activations, not new parameter-sized buffers
                    model.zero_grad(set_to_none=False)
                    model(idx, idx, return_logits=False)[1].backward()

                step()  # warm-up (and gradients allocated)
                peak = peak_memory(step, device)
                times = []
                for _ in range(2):
                    synchronize(device)
                    t0 = time.perf_counter()
                    step()
                    synchronize(device)
                    times.append(time.perf_counter() - t0)
                rows.append(dict(attention=attention, n_layer=n_layer, reversible=rev, peak_bytes=peak,
                                 step_s=min(times)))
                print(f"{attention:8s} L={n_layer:2d} reversible={rev!s:5s}: peak {peak / 2**20:8.1f} MiB, "
                      f"step {min(times) * 1e3:7.1f} ms", flush=True)
                del model
    return rows


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(prog="python -m lintrans.bench.reformer", description=__doc__.splitlines()[0])
    ap.add_argument("what", choices=["error", "memory"])
    ap.add_argument("--out", required=True, help="folder for the JSON record")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    args = ap.parse_args(argv)
    from .machine import machine_info

    from lintrans._io import atomic_write_text, writable_folder

    from lintrans.device import resolve_device

    try:  # before the work
        device = str(resolve_device(args.device, what="--device"))
        out = writable_folder(args.out, "--out")
    except ValueError as e:
        raise SystemExit(str(e))
    fn = lsh_error if args.what == "error" else reversible_memory
    rows = fn() if args.what == "error" else fn(device)
    # the settings the rows were made with (the function's defaults), so the record reproduces itself
    settings = {k: (list(p.default) if isinstance(p.default, tuple) else p.default)
                for k, p in inspect.signature(fn).parameters.items() if p.default is not inspect.Parameter.empty}
    if fn is reversible_memory:
        settings["device"], settings["vocab_size"] = device, MEMORY_VOCAB
    command = " ".join(["python -m lintrans.bench.reformer", *(sys.argv[1:] if argv is None else argv)])
    record = {"benchmark": f"reformer {args.what}", "date": time.strftime("%Y-%m-%d"), "command": command,
              "settings": settings, "machine": machine_info(device), "rows": rows}
    atomic_write_text(out / f"{args.what}.json", json.dumps(record, indent=1))
    print(f"wrote {out / (args.what + '.json')}")


if __name__ == "__main__":
    main()
