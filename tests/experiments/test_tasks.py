import pytest
import torch

from lintrans.experiments.tasks import least_squares_errors, recall_batch, regression_batch, regression_tokens


def gen(seed=0):
    return torch.Generator().manual_seed(seed)


def test_regression_targets_are_exactly_linear():
    xs, ys, w = regression_batch(7, 9, 4, gen())
    assert xs.shape == (7, 9, 4) and ys.shape == (7, 9) and w.shape == (7, 4)
    expected = (xs.double() * w.double()[:, None, :]).sum(-1)
    torch.testing.assert_close(ys.double(), expected, atol=1e-5, rtol=1e-5)
    # each sequence has its own w
    assert not torch.allclose(w[0], w[1])


def test_regression_is_seeded():
    a = regression_batch(3, 5, 2, gen(1))
    b = regression_batch(3, 5, 2, gen(1))
    c = regression_batch(3, 5, 2, gen(2))
    for x, y in zip(a, b):
        assert torch.equal(x, y)
    assert not torch.equal(a[0], c[0])


def test_regression_tokens_interleave_x_and_y():
    xs, ys, _ = regression_batch(2, 4, 3, gen())
    seq = regression_tokens(xs, ys)
    assert seq.shape == (2, 7, 3)
    assert torch.equal(seq[:, 0::2], xs)
    assert torch.equal(seq[:, 1::2, 0], ys[:, :3])
    assert torch.all(seq[:, 1::2, 1:] == 0)


def test_least_squares_is_exact_once_examples_reach_the_dimension():
    xs, ys, _ = regression_batch(16, 8, 3, gen())
    err = least_squares_errors(xs, ys)
    assert err.shape == (16, 8)
    assert torch.all(err[:, 3:] < 1e-8)  # k >= n examples determine w
    assert torch.equal(err[:, 0], ys[:, 0].double() ** 2)  # no examples: predict 0
    assert err[:, 1].mean() > 0.1  # one example in 3 dimensions cannot pin w down


def test_recall_answers_are_the_values_paired_with_the_keys():
    P, Q, K, V = 6, 4, 10, 7
    idx, targets = recall_batch(32, P, Q, K, V, gen())
    assert idx.shape == targets.shape == (32, 2 * (P + Q))
    keys, values = idx[:, : 2 * P : 2], idx[:, 1 : 2 * P : 2]
    assert torch.all(keys < K) and torch.all((values >= K) & (values < K + V))
    for b in range(32):
        assert len(set(keys[b].tolist())) == P  # distinct keys
        pairs = dict(zip(keys[b].tolist(), values[b].tolist()))
        queries = idx[b, 2 * P :: 2].tolist()
        assert len(set(queries)) == Q
        for j, q in enumerate(queries):
            pos = 2 * P + 2 * j
            assert targets[b, pos] == pairs[q]
            assert idx[b, pos + 1] == pairs[q]  # teacher-forced answer follows its query
    asked = targets >= 0
    assert asked.sum() == 32 * Q
    assert torch.all(asked[:, 2 * P :: 2])


def test_recall_with_a_filler_hides_the_answers():
    """Zoology's MQAR: the token after each query is the filler, never its answer; the pairs, queries
    and targets are those of the same draws with the answers shown."""
    P, Q, K, V = 6, 6, 10, 7
    shown, t_shown = recall_batch(16, P, Q, K, V, gen())
    hidden, t_hidden = recall_batch(16, P, Q, K, V, gen(), filler=K + V)
    assert torch.equal(t_hidden, t_shown)
    assert torch.all(hidden[:, 2 * P + 1 :: 2] == K + V)
    assert torch.equal(hidden[:, : 2 * P + 1], shown[:, : 2 * P + 1])
    assert torch.equal(hidden[:, 2 * P :: 2], shown[:, 2 * P :: 2])
    values = hidden[:, 1 : 2 * P : 2]
    for b in range(16):  # no value of the sequence appears after its pairs
        assert not set(hidden[b, 2 * P :].tolist()) & set(values[b].tolist())
    with pytest.raises(ValueError, match="filler"):
        recall_batch(2, P, Q, K, V, gen(), filler=K + V - 1)


@pytest.mark.parametrize("kwargs, match", [
    (dict(n_pairs=5, n_queries=2, n_keys=4, n_values=3), "n_pairs"),
    (dict(n_pairs=3, n_queries=4, n_keys=8, n_values=3), "n_queries"),
    (dict(n_pairs=0, n_queries=0, n_keys=8, n_values=3), "n_pairs"),
])
def test_recall_rejects_bad_sizes(kwargs, match):
    with pytest.raises(ValueError, match=match):
        recall_batch(2, **kwargs)


def test_regression_rejects_bad_sizes():
    with pytest.raises(ValueError, match="dim"):
        regression_batch(2, 3, 0)
    with pytest.raises(TypeError, match="n_points"):
        regression_batch(2, 2.5, 3)


def test_averaging_and_nearest_neighbour_baselines():
    from lintrans.experiments.tasks import averaging_errors, nearest_neighbour_errors

    xs, ys, w = regression_batch(4, 6, 3, gen())
    avg, nn = averaging_errors(xs, ys), nearest_neighbour_errors(xs, ys)
    assert avg.shape == nn.shape == (4, 6)
    assert torch.equal(avg[:, 0], ys[:, 0].double() ** 2) and torch.equal(nn[:, 0], avg[:, 0])
    b, k = 1, 4  # by hand at one point
    w_hat = (ys[b, :k, None].double() * xs[b, :k].double()).mean(0)
    assert avg[b, k] == pytest.approx(float((w_hat @ xs[b, k].double() - ys[b, k]) ** 2))
    near = (xs[b, :k] - xs[b, k]).norm(dim=-1).argsort()[:3]
    assert nn[b, k] == pytest.approx(float((ys[b, near].double().mean() - ys[b, k]) ** 2))
    assert nn[b, 1] == pytest.approx(float((ys[b, 0] - ys[b, 1]) ** 2))  # one earlier point: its y
