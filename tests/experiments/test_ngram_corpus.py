"""The n-gram baselines against hand-computed probabilities, and the stdlib code corpus's split."""
import math

import numpy as np
import pytest

from lintrans.experiments import code_corpus
from lintrans.experiments.ngram import NGram, baselines, choose_alphas, windows_of

# tokens 0 1 2 0 1 over V=3, alphas 1: c(0)=2 c(1)=2 c(2)=1; bigrams 01 x2, 12, 20; trigrams 012 120 201
P1 = {0: 7 / 18, 1: 7 / 18, 2: 2 / 9}  # (c + 1/3) / (5 + 1)
P2_1_0 = (2 + 7 / 18) / 3  # p(1 | 0)
P2_2_1 = (1 + 2 / 9) / 2  # p(2 | 1)
P2_0_1 = (0 + 7 / 18) / 2  # p(0 | 1): unseen after 1
P3_2_01 = (1 + P2_2_1) / 2  # p(2 | 0 1)
P3_0_01 = (0 + P2_0_1) / 2  # p(0 | 0 1)


def model():
    return NGram(np.array([0, 1, 2, 0, 1]), 3, (1.0, 1.0, 1.0))


def test_probabilities_by_hand():
    m = model()
    for w, p in P1.items():
        assert m.p1(w) == pytest.approx(p, rel=1e-12)
    assert sum(m.p1(w) for w in range(3)) == pytest.approx(1.0)
    assert m.p2(0, 1) == pytest.approx(P2_1_0, rel=1e-12)
    assert m.p2(1, 0) == pytest.approx(P2_0_1, rel=1e-12)
    assert m.p3(0, 1, 2) == pytest.approx(P3_2_01, rel=1e-12)
    assert m.p3(0, 1, 0) == pytest.approx(P3_0_01, rel=1e-12)
    assert m.p3(2, 2, 1) == pytest.approx(m.p2(2, 1), rel=1e-12)  # unseen context: the bigram
    for a in range(3):  # every conditional sums to one
        assert sum(m.p2(a, w) for w in range(3)) == pytest.approx(1.0)
        for b in range(3):
            assert sum(m.p3(a, b, w) for w in range(3)) == pytest.approx(1.0)


def test_token_losses_cut_context_at_window_start():
    m = model()
    w = np.array([[0, 1, 2], [0, 1, 0]])
    tri = m.token_losses(w, 3)
    # first target of a window has one token of context: the trigram is the bigram there
    np.testing.assert_allclose(tri, -np.log([[P2_1_0, P3_2_01], [P2_1_0, P3_0_01]]), rtol=1e-12)
    np.testing.assert_allclose(m.token_losses(w, 2), -np.log([[P2_1_0, P2_2_1], [P2_1_0, P2_0_1]]), rtol=1e-12)
    np.testing.assert_allclose(m.token_losses(w, 1), -np.log([[P1[1], P1[2]], [P1[1], P1[0]]]), rtol=1e-12)
    with pytest.raises(ValueError, match="order"):
        m.token_losses(w, 4)


def test_bad_input():
    with pytest.raises(ValueError, match="token ids"):
        NGram(np.array([0, 1, 5]), 3)
    with pytest.raises(ValueError, match="alphas"):
        NGram(np.array([0, 1, 2]), 3, (1.0, 0.0, 1.0))
    with pytest.raises(ValueError, match="multiple of T"):
        windows_of(np.arange(10), 7, 2)


def test_windows_and_baselines_on_a_periodic_stream():
    # a period-3 stream: the trigram (and bigram) know every next token; the unigram does not
    train = np.tile([0, 1, 2], 200)
    w = windows_of(np.tile([0, 1, 2], 10), 12, 4)
    np.testing.assert_array_equal(w[1], [1, 2, 0, 1, 2])
    out = baselines(train, {4: w}, 3, buckets={4: [(1, 1), (2, 4)]})
    loss = out["loss"]
    assert loss["unigram"]["4"] == pytest.approx(math.log(3), abs=0.01)
    assert loss["trigram"]["4"] < 0.05 and loss["bigram"]["4"] < 0.05
    assert len(out["by_position"]["trigram"]["4"]) == 2
    assert choose_alphas(train, 3)[2] == 0.1  # deterministic data: the least smoothing on the grid


def test_corpus_split_by_file(tmp_path):
    for rel in ["a.py", "pkg/b.py", "pkg/test_c.py", "test/d.py", "site-packages/e.py", "pkg/f.txt",
                *[f"m{i}.py" for i in range(30)]]:
        p = tmp_path / rel
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_bytes(rel.encode() * 3)
    files = code_corpus.source_files(tmp_path)
    names = [f.as_posix() for f in files]
    assert "pkg/test_c.py" not in names and "test/d.py" not in names and "site-packages/e.py" not in names
    assert "pkg/f.txt" not in names and "a.py" in names and names == sorted(names)
    c = code_corpus.build(tmp_path)
    held = [f for f in files if code_corpus.is_held_out(f)]
    assert c.info["val_files"] == len(held) and c.info["train_files"] == len(files) - len(held)
    assert c.info["val_tokens"] == sum(len((tmp_path / f).read_bytes()) + 1 for f in held)
    assert (c.val == code_corpus.EOT).sum() == len(held)
    assert c.train.max() <= 256
    again = code_corpus.build(tmp_path)
    assert again.info["sha256"] == c.info["sha256"]
    (tmp_path / "a.py").write_bytes(b"changed")
    assert code_corpus.build(tmp_path).info["sha256"] != c.info["sha256"]


def test_position_buckets_and_lr_interpolation():
    from lintrans.experiments.context import interpolated_lr, position_buckets, split_mechanism

    assert position_buckets(4096) == [(1, 16), (17, 64), (65, 256), (257, 1024), (1025, 4096)]
    assert position_buckets(100) == [(1, 16), (17, 64), (65, 100)]
    assert position_buckets(8) == [(1, 8)]
    assert interpolated_lr({256: 4e-3, 4096: 1e-3}, 1024) == pytest.approx(2e-3, rel=1e-3)  # halfway in log T
    assert interpolated_lr({256: 4e-3, 4096: 1e-3}, 4096) == 1e-3
    assert split_mechanism("linear:elu@none") == ("linear:elu", "none")
    assert split_mechanism("softmax") == ("softmax", "learned")
    with pytest.raises(ValueError, match="after '@'"):
        split_mechanism("softmax@rotary")


def test_loss_by_position_of_a_tiny_model():
    import torch

    from lintrans.experiments.context import CodeStream, bucket_means, position_buckets, token_losses
    from lintrans.models import GPT, GPTConfig

    torch.manual_seed(0)
    model = GPT(GPTConfig(n_layer=1, n_head=2, n_embd=16, block_size=20, vocab_size=257,
                          pos_embedding="rope")).eval()
    corpus = code_corpus.CodeCorpus(train=np.arange(500, dtype=np.uint16) % 257,
                                    val=(np.arange(300, dtype=np.uint16) * 7) % 257, info={})
    stream = CodeStream(20, 40, steps=2, seed=0, val_tokens=80, corpus=corpus)
    ev = stream.evaluate(model)
    # by hand: every window's per-token loss, then the means over positions 1-16 and 17-20
    windows = torch.from_numpy(windows_of(corpus.val, 80, 20))
    with torch.no_grad():
        logits, _ = model(windows[:, :-1])
    per_token = torch.nn.functional.cross_entropy(logits.flatten(0, 1), windows[:, 1:].flatten(),
                                                  reduction="none").view(4, 20)
    assert ev["val_loss"] == pytest.approx(float(per_token.mean()), rel=1e-6)
    assert ev["by_position"] == pytest.approx([float(per_token[:, :16].mean()), float(per_token[:, 16:].mean())],
                                              rel=1e-6)
    assert position_buckets(20) == [(1, 16), (17, 20)]
    with torch.no_grad():
        assert bucket_means(token_losses(model, windows[:, :-1], windows[:, 1:]), 20) == pytest.approx(
            ev["by_position"], rel=1e-6)
    x, y = stream.batch(1)
    assert x.shape == (2, 20) and torch.equal(x[:, 1:], y[:, :-1])


def test_cached_baselines_are_recomputed_when_the_ngram_version_changes(tmp_path, monkeypatch):
    """The context study keeps its n-gram baselines on disk; a cache from an older definition of the
    baselines (ngram.VERSION) must not be reused, while version 1's key is the one records already hold."""
    from lintrans.experiments import context, ngram

    computed = []
    monkeypatch.setattr(context, "_baselines_for", lambda contexts, val: computed.append(1) or {"n": len(computed)})
    s = {"contexts": [8, 16], "val_tokens": 64}
    assert context._baselines(s, tmp_path, "abc") == {"n": 1}
    assert context._baselines(s, tmp_path, "abc") == {"n": 1}  # cached
    monkeypatch.setattr(ngram, "VERSION", 2)
    assert context._baselines(s, tmp_path, "abc") == {"n": 2}  # a new definition: computed again
    assert len(list((tmp_path / "runs").glob("*.ngram"))) == 2
