"""``lintrans train``: config file + overrides -> a (resumable) training run.

    lintrans train                                   # the shipped tiny config: a few CPU minutes
    lintrans train --config tiny --set train.max_steps=200
    lintrans train --config tiny --train.out_dir runs/x --model.attention linear
    .venv/bin/torchrun --standalone --nproc_per_node 2 -m lintrans train --config tiny
"""
from __future__ import annotations

import argparse
import sys

DEFAULT_CONFIG = "tiny"  # what a bare `lintrans train` trains


def default_config_path():
    """The package's copy of DEFAULT_CONFIG, never a file of that name in the current folder."""
    from .config import SHIPPED_CONFIGS

    return SHIPPED_CONFIGS / f"{DEFAULT_CONFIG}.toml"


def configure(parser: argparse.ArgumentParser) -> None:
    from lintrans.config import add_arguments, flatten
    from lintrans.tokenizer import ByteTokenizer, GPT2Tokenizer

    from .config import TrainConfig, padded_vocab, read_config_file

    parser.formatter_class = argparse.RawDescriptionHelpFormatter
    parser.epilog = __doc__.split("\n", 2)[2]
    parser.add_argument("--config", "-c", metavar="FILE", default=None,
                        help="TOML or YAML config (sections model/data/optim/train), or a shipped config by name: "
                             "tiny (the default), gpt2-124m")
    parser.add_argument("--set", "-s", action="append", default=[], metavar="KEY=VALUE", dest="overrides",
                        help="override one config key, e.g. train.max_steps=500 (repeatable)")
    parser.add_argument("--print-config", action="store_true", help="print the resolved config and exit")
    parser.add_argument("--device", default=None, help="train.device: auto, cpu, cuda, cuda:N or mps")
    keys = parser.add_argument_group(
        "config keys", "every key of the config, the same as --set KEY=VALUE. The defaults shown are those of "
                       "the bare command, the shipped tiny config with GPTConfig's and TrainConfig's defaults for "
                       "what it leaves unset; with --config FILE unset keys take those of TrainConfig and "
                       "GPTConfig (--print-config shows the result; see docs/training.md)")
    shown = flatten(TrainConfig, read_config_file(default_config_path()))
    sizes = ", ".join(f"{t.name}: {padded_vocab(t.vocab_size)}" for t in (ByteTokenizer, GPT2Tokenizer))
    shown.setdefault("model.vocab_size", f"the tokenizer's, rounded up to a multiple of 64 ({sizes})")
    add_arguments(keys, TrainConfig, defaults=shown)
    # every key is listed below; the usage line would otherwise repeat all of them
    parser.usage = "%(prog)s [-h] [--config FILE] [--set KEY=VALUE] [--print-config] [--device DEVICE] [--SECTION.KEY VALUE ...]"


def run(args: argparse.Namespace) -> int:
    from lintrans.config import given_flags

    from .config import load_config

    flags = given_flags(args)
    if args.device is not None and any(key == "train.device" for key, _ in flags):
        print("lintrans train: give --device or --train.device, not both (they are the same key)", file=sys.stderr)
        return 2
    overrides = list(args.overrides) + ([f"train.device={args.device}"] if args.device is not None else [])
    overrides += [f"{key}={value}" for key, value in flags]
    config = args.config
    try:  # whether the command line starts from weights (an empty value does not)
        init_from = load_config(None, [o for o in overrides if o.split("=", 1)[0].strip() == "train.init_from"]
                                ).train.init_from
        fine_tune = bool(init_from)
    except (ValueError, TypeError) as e:
        print(f"lintrans train: {e}", file=sys.stderr)
        return 2
    if config is None:
        # the bare command trains something small on the embedded corpus, not GPT-2 124M on a CPU
        config = default_config_path()
        if fine_tune:
            print("lintrans train: no --config given, using the shipped 'tiny' config's data, optimizer and "
                  "training settings; the model is train.init_from's", file=sys.stderr)
            from lintrans.models.hf import trained_tokenizer

            given = {o.split("=", 1)[0].strip() for o in overrides}
            theirs = trained_tokenizer(init_from)
            if "data.tokenizer" not in given and theirs is not None:
                # the tiny config's tokenizer (bytes) would feed GPT-2's weights byte ids as their tokens
                overrides.append(f"data.tokenizer={theirs}")
                print(f"lintrans train: data.tokenizer {theirs}, the initial weights' own", file=sys.stderr)
        else:
            print("lintrans train: no --config given, using the shipped 'tiny' config (a 4-layer, 128-wide GPT on the "
                  "embedded corpus, with the command line's keys over it); --config gpt2-124m or a file of your own "
                  "for more", file=sys.stderr)
    try:
        # the tiny config's [model] describes its own model: applied to initial weights it would swap a
        # linear checkpoint to its softmax; with init_from only the command line's model keys apply
        cfg = load_config(config, overrides, file_model=not (args.config is None and fine_tune))
    except (ValueError, TypeError, FileNotFoundError, ImportError) as e:
        print(f"lintrans train: {e}", file=sys.stderr)
        return 2
    if args.print_config:
        from lintrans.config import dump

        print(dump(cfg), end="")
        if fine_tune:
            from lintrans.models.hf import WEIGHT_PRESERVING

            unused = sorted(f"model.{k}" for k in cfg.model if k not in WEIGHT_PRESERVING)
            if unused:  # the run says so when it starts; the printed config should not suggest otherwise
                print(f"lintrans train: with train.init_from the model's shape is the weights'; {unused} will not be "
                      f"used (only {['model.' + k for k in WEIGHT_PRESERVING]} apply)", file=sys.stderr)
        return 0
    from .loop import train

    try:
        result = train(cfg)
    except (ValueError, TypeError, FileNotFoundError, ImportError) as e:
        print(f"lintrans train: {e}", file=sys.stderr)
        return 2
    return result.exit_code
