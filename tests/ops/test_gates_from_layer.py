"""``gates_from_layer``: a layer's decoding step skips reading the values of gates it made in range
(beta from a sigmoid, log-decays from -softplus); shapes are still checked, and only inside it, in
its own thread."""
import threading

import pytest
import torch

from lintrans.ops import delta_rule_step, linear_attention_step
from lintrans.ops.validation import gates_from_layer


def _delta(beta=None, ld=None):
    q = k = v = torch.randn(1, 2, 4)
    return delta_rule_step(q, k, v, torch.full((1, 2), 0.5) if beta is None else beta, log_decay=ld)


def _linear(ld):
    q = k = v = torch.randn(1, 2, 4)
    return linear_attention_step(q, k, v, log_decay=ld)


CASES = [
    (lambda: _delta(beta=torch.full((1, 2), 3.0)), "beta must be finite and in"),
    (lambda: _delta(ld=torch.full((1, 2), 0.5)), "log_decay must be finite and <= 0"),
    (lambda: _linear(torch.full((2,), float("nan"))), "log_decay must be finite and <= 0"),
]


@pytest.mark.parametrize("call, message", CASES)
def test_values_are_read_outside_and_not_inside(call, message):
    with pytest.raises(ValueError, match=message):
        call()
    with gates_from_layer():
        call()  # not read: the layer vouches for them
        with gates_from_layer():
            call()
        call()  # the inner exit restores the outer state
    with pytest.raises(ValueError, match=message):
        call()


def test_shapes_are_still_checked_inside():
    with gates_from_layer():
        with pytest.raises(ValueError, match="beta must have shape"):
            _delta(beta=torch.full((1, 3), 0.5))
        with pytest.raises(ValueError, match="log_decay must have shape"):
            _linear(torch.zeros(3))


def test_another_thread_still_reads_the_values():
    call, message = CASES[0]
    seen = []

    def other():
        try:
            call()
        except ValueError as e:
            seen.append(str(e))

    with gates_from_layer():
        t = threading.Thread(target=other)
        t.start()
        t.join()
    assert seen and message in seen[0]
