"""`lintrans sample`: generate text from a checkpoint, streaming it as it is produced."""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

from lintrans.checks import check_positive_int


def configure(parser: argparse.ArgumentParser) -> None:
    src = parser.add_mutually_exclusive_group(required=True)
    src.add_argument("--checkpoint", help="lintrans checkpoint folder, Hugging Face GPT-2 folder or nanoGPT ckpt.pt")
    src.add_argument("--hf", metavar="PATH_OR_NAME",
                     help="Hugging Face GPT-2 folder, or a model name found in the local HF cache (e.g. gpt2)")
    text = parser.add_mutually_exclusive_group()
    text.add_argument("--prompt", default="\n", help="text to continue (default: a newline)")
    text.add_argument("--prompt-file", metavar="PATH", default=None,
                      help="read the text to continue from a UTF-8 file (- for standard input)")
    parser.add_argument("--tokenizer", choices=("gpt2", "bytes"), default=None,
                        help="default: the one a lintrans checkpoint records, else bytes for a vocabulary "
                        "smaller than GPT-2's, else gpt2")
    parser.add_argument("--max-new-tokens", type=int, default=200,
                        help="tokens to generate per sample (default 200); may exceed the block size: with learned positions (or AFT-full/local, cosFormer) "
                             "the context is then cropped to the last block_size (max_len) tokens, as nanoGPT does")
    parser.add_argument("--num-samples", type=int, default=1, help="independent samples, separated by --- (default 1)")
    parser.add_argument("--temperature", type=float, default=0.8, help="softmax temperature of the next-token distribution (default 0.8; 0 = greedy)")
    parser.add_argument("--top-k", type=int, default=None, help="sample from the k most likely tokens only (default: all)")
    parser.add_argument("--top-p", type=float, default=None,
                        help="nucleus sampling: from the fewest tokens whose probabilities sum to p (default: all)")
    parser.add_argument("--seed", type=int, default=None, help="seed of the sampler: equal seeds, equal text; "
                        "sample n of --num-samples takes seed + n (default: a fresh draw)")
    parser.add_argument("--ignore-eot", action="store_true",
                        help="go on past the tokenizer's end-of-text token (default: a sample ends there, as a "
                             "document does)")
    parser.add_argument("--attention", default=None, help="swap the attention mechanism (e.g. linear); weights kept")
    parser.add_argument("--device", default="cpu", help="cpu (default), auto, cuda, cuda:N or mps")


def run(args: argparse.Namespace) -> int:
    import torch

    from .hf import from_pretrained, load_model, trained_tokenizer

    from lintrans.device import resolve_device

    try:
        args.device = resolve_device(args.device, what="--device")
    except ValueError as e:
        print(f"lintrans sample: {e}", file=sys.stderr)
        return 2
    overrides = {"attention": args.attention} if args.attention else {}
    try:
        model = from_pretrained(args.hf, **overrides) if args.hf else load_model(args.checkpoint, **overrides)
    except (FileNotFoundError, ValueError, TypeError) as e:
        print(f"lintrans sample: {e}", file=sys.stderr)
        return 2
    model.to(args.device).eval()
    from lintrans.tokenizer import GPT2Tokenizer, get_tokenizer

    # a model too small for GPT-2's vocabulary is a byte model (lintrans pads 257 bytes to 320)
    name = args.tokenizer or trained_tokenizer(args.checkpoint or args.hf) or (
        "bytes" if model.config.vocab_size < GPT2Tokenizer.vocab_size else "gpt2"
    )
    tok = get_tokenizer(name)
    if tok.vocab_size > model.config.vocab_size:
        print(f"lintrans sample: tokenizer {name!r} has {tok.vocab_size} tokens but the model only "
              f"{model.config.vocab_size}; pick the tokenizer the model was trained with", file=sys.stderr)
        return 2
    if args.prompt_file is not None:
        try:
            args.prompt = sys.stdin.read() if args.prompt_file == "-" else Path(args.prompt_file).read_text("utf-8")
        except (OSError, UnicodeDecodeError) as e:
            print(f"lintrans sample: --prompt-file {args.prompt_file}: {getattr(e, 'strerror', None) or e}",
                  file=sys.stderr)
            return 2
    ids = tok.encode(args.prompt)
    if not ids:
        print(f"lintrans sample: {'--prompt-file' if args.prompt_file else '--prompt'} must not be empty",
              file=sys.stderr)
        return 2
    from .generate import check_sampling

    try:  # before anything is printed
        check_positive_int("--num-samples", args.num_samples)
        flag = lambda name: "--" + name.replace("_", "-")  # noqa: E731
        check_sampling(args.max_new_tokens, args.temperature, args.top_k, args.top_p, args.seed, label=flag)
        if args.seed is not None and args.num_samples > 1:  # sample n is seeded with seed + n
            check_sampling(args.max_new_tokens, args.temperature, args.top_k, args.top_p,
                           args.seed + args.num_samples - 1, label=flag)
    except (ValueError, TypeError) as e:
        print(f"lintrans sample: {e}", file=sys.stderr)
        return 2
    idx = torch.tensor([ids], dtype=torch.long, device=args.device)
    out = sys.stdout
    for n in range(args.num_samples):
        if n:
            out.write("---\n")
        # each sample its own stream: seed, seed + 1, ... so a seeded run is reproducible sample by sample
        seed = None if args.seed is None else args.seed + n
        try:
            _stream(model, tok, idx, args, seed, out)
        except ValueError as e:
            print(f"\nlintrans sample: {e}", file=sys.stderr)
            return 2
    return 0


def _stream(model, tok, idx, args, seed, out) -> None:
    """Write the prompt and its continuation as it is generated."""
    out.write(args.prompt)
    out.flush()
    # decode the growing tail so multi-byte characters split across tokens print correctly
    pending: list[int] = []
    eot = None if args.ignore_eot else tok.eot_token
    for nxt in model.generate_stream(idx, args.max_new_tokens, args.temperature, args.top_k, args.top_p, seed,
                                     vocab_limit=tok.vocab_size,  # never a padding id: it has no text
                                     eos_token_id=eot):
        if int(nxt[0, 0]) == eot:  # the end of the text: nothing to print for it
            break
        pending.append(int(nxt[0, 0]))
        text = tok.decode(pending)
        if not text.endswith("\ufffd"):
            out.write(text)
            out.flush()
            pending = []
    if pending:
        out.write(tok.decode(pending))
    out.write("\n")
    out.flush()
