"""`lintrans experiment regression|recall`: in-context learning tasks compared across attention kinds.

Writes <task>.json (settings, machine, per-step training loss, held-out metrics, baselines),
<task>_curves.png (learning curves) and <task>_eval.png (error against in-context examples for
regression, accuracy per kind for recall), and prints a table.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from .runner import TASKS, ExperimentConfig, run_experiment, smooth

_DEFAULTS = ExperimentConfig(task="regression")


def configure(p: argparse.ArgumentParser) -> None:
    d = _DEFAULTS
    p.add_argument("task", choices=TASKS)
    p.add_argument("--attention", nargs="+", default=d.attention, metavar="SPEC",
                   help="kinds to compare: softmax, linear:elu, linear:based, sliding-window:window=8, "
                        "NAME:key=value,... (default: %(default)s)")
    p.add_argument("--steps", type=int, default=d.steps, help="training steps per kind (default: %(default)s)")
    p.add_argument("--batch-size", type=int, default=d.batch_size)
    p.add_argument("--lr", type=float, default=d.lr, help="peak AdamW learning rate (default: %(default)s)")
    p.add_argument("--seed", type=int, default=d.seed)
    p.add_argument("--eval-batch", type=int, default=d.eval_batch, help="held-out sequences (default: %(default)s)")
    p.add_argument("--n-layer", type=int, default=d.n_layer)
    p.add_argument("--n-head", type=int, default=d.n_head)
    p.add_argument("--n-embd", type=int, default=d.n_embd)
    p.add_argument("--dim", type=int, default=d.dim, help="regression: dimension n of x and w")
    p.add_argument("--points", type=int, default=d.points, help="regression: x points per sequence")
    p.add_argument("--pairs", type=int, default=d.pairs, help="recall: key-value pairs per sequence")
    p.add_argument("--queries", type=int, default=d.queries, help="recall: queried keys per sequence")
    p.add_argument("--keys", type=int, default=d.keys, help="recall: number of key ids")
    p.add_argument("--values", type=int, default=d.values, help="recall: number of value ids")
    p.add_argument("--device", default=d.device)
    p.add_argument("--threads", type=int, default=None, help="torch intra-op threads (default: torch's choice)")
    p.add_argument("--out", type=Path, default=None, help="folder for JSON and PNG (default: print only)")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")


def table(result: dict) -> str:
    regression = result["task"] == "regression"
    w = max([28] + [len(r["attention"]) for r in result["runs"]])
    head = f"{'attention':<{w}} {'params':>8} {'train s':>8} {'final loss':>11} {'eval loss':>10}"
    head += f" {'err@last':>9}" if regression else f" {'accuracy':>9}"
    lines = [head, "-" * len(head)]
    for r in result["runs"]:
        tail = r["train_loss"][-max(1, len(r["train_loss"]) // 10):]  # mean of the last 10% of steps
        metric = r["eval"]["error_by_examples"][-1] if regression else r["eval"]["accuracy"]
        lines.append(f"{r['attention']:<{w}} {r['params']:>8} {r['train_seconds']:>8.1f} "
                     f"{sum(tail) / len(tail):>11.4f} {r['eval']['loss']:>10.4f} {metric:>9.4f}")
    b = result["baselines"]
    if regression:
        lines.append(f"{'least squares':<{w}} {'':>8} {'':>8} {'':>11} "
                     f"{sum(b['least_squares']) / len(b['least_squares']):>10.4f} {b['least_squares'][-1]:>9.4f}")
    else:
        lines.append(f"{'chance':<{w}} {'':>8} {'':>8} {'':>11} {'':>10} {b['chance_accuracy']:>9.4f}")
    return "\n".join(lines)


def plot(result: dict, out: Path) -> list[Path]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    task, runs = result["task"], result["runs"]
    subtitle = (f"{result['config']['n_layer']} layers, d={result['config']['n_embd']}, "
                f"batch {result['config']['batch_size']}, seed {result['config']['seed']}")
    paths = []
    fig, ax = plt.subplots(figsize=(6.5, 4.5))
    window = max(1, len(runs[0]["train_loss"]) // 50)
    for r in runs:
        ax.plot(range(1, len(r["train_loss"]) + 1), smooth(r["train_loss"], window), label=r["attention"])
    ax.set_yscale("log")
    ax.set_xlabel("step")
    ax.set_ylabel("training loss" + (" (squared error / n)" if task == "regression" else " (cross-entropy)"))
    ax.set_title(f"{task}: learning curves (mean over {window} steps)\n{subtitle}", fontsize=9)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    paths.append(out / f"{task}_curves.png")
    fig.tight_layout()
    fig.savefig(paths[-1], dpi=120)
    plt.close(fig)

    fig, ax = plt.subplots(figsize=(6.5, 4.5))
    if task == "regression":
        b = result["baselines"]
        ks = range(len(b["least_squares"]))
        for r in runs:
            ax.plot(ks, r["eval"]["error_by_examples"], marker="o", ms=3, label=r["attention"])
        # baselines on top: a kind that learned nothing lies exactly on "predict 0"
        ax.plot(ks, b["least_squares"], "k--", label="least squares", zorder=5)
        ax.plot(ks, b["zero"], ":", color="grey", lw=2.5, label="predict 0", zorder=5)
        ax.set_xlabel("in-context examples")
        ax.set_ylabel("squared error / n (held-out)")
        ax.set_title(f"in-context linear regression, n={result['config']['dim']}\n{subtitle}", fontsize=9)
        ax.legend(fontsize=8)
    else:
        names = [r["attention"] for r in runs]
        ax.bar(names, [r["eval"]["accuracy"] for r in runs])
        ax.axhline(result["baselines"]["chance_accuracy"], color="grey", ls=":", label="chance")
        ax.set_ylim(0, 1)
        ax.set_ylabel("accuracy at queries (held-out)")
        c = result["config"]
        ax.set_title(f"associative recall: {c['pairs']} pairs, {c['queries']} queries, {c['values']} values\n"
                     f"{subtitle}", fontsize=9)
        ax.legend(fontsize=8)
        plt.setp(ax.get_xticklabels(), rotation=20, ha="right", fontsize=8)
    ax.grid(alpha=0.3)
    paths.append(out / f"{task}_eval.png")
    fig.tight_layout()
    fig.savefig(paths[-1], dpi=120)
    plt.close(fig)
    return paths


def _config(args: argparse.Namespace) -> ExperimentConfig:
    names = [f.name for f in ExperimentConfig.__dataclass_fields__.values()]
    return ExperimentConfig(**{n: getattr(args, n) for n in names})


def run(args: argparse.Namespace) -> int:
    import torch
    from tqdm import tqdm

    from lintrans.bench.machine import machine_info
    from lintrans._io import atomic_write_text

    try:
        cfg = _config(args)
        if args.threads is not None:
            if args.threads < 1:
                raise ValueError(f"--threads must be >= 1, got {args.threads}")
            torch.set_num_threads(args.threads)
        if cfg.device != "cpu" and not (cfg.device.startswith("cuda") and torch.cuda.is_available()):
            raise ValueError(f"--device must be 'cpu' or an available 'cuda[:N]', got {cfg.device!r}")
        bar = tqdm(total=cfg.steps * len(cfg.attention), file=sys.stderr, dynamic_ncols=True,
                   disable=args.no_progress, desc=cfg.task)

        def on_step(spec: str, step: int, loss: float) -> None:
            bar.set_postfix_str(f"{spec} loss {loss:.4f}", refresh=False)
            bar.update(1)

        result = run_experiment(cfg, on_step)
        bar.close()
    except (ValueError, TypeError, NotImplementedError) as e:
        print(f"lintrans experiment: {e}", file=sys.stderr)
        return 2
    result["machine"] = machine_info(cfg.device)
    print(table(result))
    if args.out is not None:
        args.out.mkdir(parents=True, exist_ok=True)
        path = args.out / f"{cfg.task}.json"
        atomic_write_text(path, json.dumps(result, indent=1))
        for p in [path, *plot(result, args.out)]:
            print(f"wrote {p}")
    return 0
