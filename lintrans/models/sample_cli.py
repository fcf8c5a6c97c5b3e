"""`lintrans sample`: generate text from a checkpoint, streaming it as it is produced."""
from __future__ import annotations

import argparse
import sys


def configure(parser: argparse.ArgumentParser) -> None:
    src = parser.add_mutually_exclusive_group(required=True)
    src.add_argument("--checkpoint", help="lintrans checkpoint folder, Hugging Face GPT-2 folder or nanoGPT ckpt.pt")
    src.add_argument("--hf", metavar="PATH_OR_NAME",
                     help="Hugging Face GPT-2 folder, or a model name found in the local HF cache (e.g. gpt2)")
    parser.add_argument("--prompt", default="\n", help="text to continue (default: a newline)")
    parser.add_argument("--tokenizer", choices=("gpt2", "bytes"), default=None,
                        help="default: the one a lintrans checkpoint records, else bytes for a 257-token "
                        "vocabulary, else gpt2")
    parser.add_argument("--max-new-tokens", type=int, default=200)
    parser.add_argument("--temperature", type=float, default=0.8, help="0 = greedy")
    parser.add_argument("--top-k", type=int, default=None)
    parser.add_argument("--top-p", type=float, default=None)
    parser.add_argument("--seed", type=int, default=None)
    parser.add_argument("--attention", default=None, help="swap the attention mechanism (e.g. linear); weights kept")
    parser.add_argument("--device", default="cpu")


def _tokenizer(name: str):
    try:
        from lintrans.train.tokenizer import get_tokenizer
    except ModuleNotFoundError as e:  # training package not built yet: bytes need nothing
        if name != "bytes" or e.name not in ("lintrans.train.tokenizer", "lintrans.train"):
            raise
        from types import SimpleNamespace

        return SimpleNamespace(
            vocab_size=257, encode=lambda s: list(s.encode("utf-8")),
            decode=lambda ids: bytes(i for i in ids if i < 256).decode("utf-8", errors="replace"),
        )
    return get_tokenizer(name)


def _saved_tokenizer(checkpoint) -> str | None:
    """The tokenizer a lintrans training checkpoint records in its config.json, if any."""
    import json
    from pathlib import Path

    if not checkpoint or not (Path(checkpoint) / "config.json").is_file():
        return None
    name = json.loads((Path(checkpoint) / "config.json").read_text()).get("tokenizer")
    return name if name in ("gpt2", "bytes") else None


def run(args: argparse.Namespace) -> int:
    import torch

    from .hf import from_pretrained, load_model

    overrides = {"attention": args.attention} if args.attention else {}
    try:
        model = from_pretrained(args.hf, **overrides) if args.hf else load_model(args.checkpoint, **overrides)
    except (FileNotFoundError, ValueError) as e:
        print(f"lintrans sample: {e}", file=sys.stderr)
        return 2
    model.to(args.device).eval()
    name = args.tokenizer or _saved_tokenizer(args.checkpoint) or (
        "bytes" if model.config.vocab_size == 257 and not args.hf else "gpt2"
    )
    tok = _tokenizer(name)
    if tok.vocab_size > model.config.vocab_size:
        print(f"lintrans sample: tokenizer {name!r} has {tok.vocab_size} tokens but the model only "
              f"{model.config.vocab_size}; pick the tokenizer the model was trained with", file=sys.stderr)
        return 2
    ids = tok.encode(args.prompt)
    if not ids:
        print("lintrans sample: --prompt must not be empty", file=sys.stderr)
        return 2
    idx = torch.tensor([ids], dtype=torch.long, device=args.device)
    out = sys.stdout
    out.write(args.prompt)
    out.flush()
    # decode the growing tail so multi-byte characters split across tokens print correctly
    pending: list[int] = []
    try:
        for nxt in model.generate_stream(idx, args.max_new_tokens, args.temperature, args.top_k, args.top_p, args.seed):
            pending.append(int(nxt[0, 0]))
            text = tok.decode(pending)
            if not text.endswith("\ufffd"):
                out.write(text)
                out.flush()
                pending = []
    except ValueError as e:
        print(f"\nlintrans sample: {e}", file=sys.stderr)
        return 2
    if pending:
        out.write(tok.decode(pending))
    out.write("\n")
    out.flush()
    return 0
