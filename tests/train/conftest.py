import random

import pytest

from lintrans.train.config import load_config


def make_text(n_sentences: int = 600, seed: int = 0) -> str:
    """Deterministic pseudo-English with enough structure for a tiny model to learn quickly."""
    rng = random.Random(seed)
    subjects = ["the cat", "a dog", "my friend", "the old man", "a small bird", "the teacher"]
    verbs = ["sees", "likes", "follows", "paints", "finds", "calls"]
    objects = ["the river", "a red ball", "the moon", "an apple", "the garden", "a letter"]
    return "\n".join(
        f"{rng.choice(subjects).capitalize()} {rng.choice(verbs)} {rng.choice(objects)}." for _ in range(n_sentences)
    )


@pytest.fixture
def text_file(tmp_path):
    path = tmp_path / "corpus.txt"
    path.write_text(make_text())
    return path


@pytest.fixture
def tiny_config(tmp_path, text_file):
    """A factory: a config for a ~10k-parameter byte-level model that trains in well under a second."""

    def make(out="run", **overrides):
        base = {
            "data.source": str(text_file), "data.tokenizer": "bytes", "data.cache_dir": str(tmp_path / "cache"),
            "model.n_layer": 1, "model.n_head": 2, "model.n_embd": 16, "model.block_size": 16,
            "optim.lr": 3e-3, "optim.warmup_steps": 2, "train.batch_size": 4, "train.max_steps": 6,
            "train.eval_interval": 3, "train.eval_batches": 2, "train.checkpoint_interval": 100,
            "train.out_dir": str(tmp_path / out), "train.progress": False, "train.device": "cpu",
        }
        base.update(overrides)
        return load_config(None, [f"{k}={v}" for k, v in base.items()])

    return make
