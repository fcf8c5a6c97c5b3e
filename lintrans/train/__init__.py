"""Training: offline tokenizers, cached token data, a resumable DDP-aware loop (`lintrans train`).

    from lintrans.train.config import load_config
    from lintrans.train.loop import train
    train(load_config("tiny", ["train.max_steps=100"]))
"""
