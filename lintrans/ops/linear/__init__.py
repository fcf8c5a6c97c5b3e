"""Causal linear attention in the six forms of "Linear Transformers Are Faster After All".

Every form computes, for each position i and with phi the feature map,

    o_i = sum_{j<=i} s_ij v_j / (sum_{j<=i} s_ij + eps)     s_ij = scale * phi(q_i) . phi(k_j)

(without the division when ``normalize=False``), continuing from a recurrent state
``(S, z) = (sum_j phi(k_j) v_j^T, sum_j phi(k_j))`` handed in by a previous call.

Gated (decayed-state) attention: with ``log_decay`` (a_t <= 0, g_t = exp(a_t)) the state decays
before each token is added, ``S_t = g_t S_{t-1} + phi(k_t) v_t^T`` and ``z_t = g_t z_{t-1} + phi(k_t)``,
so the score of key j at query i is multiplied by ``exp(a_{j+1} + ... + a_i)``. Every form computes
that decay from differences of cumulative log-decays that are <= 0, so no ``exp`` of a positive
number is ever formed: gates that shut (a = -50) and long sequences of gates near 1 stay finite.

Implementation note: the normaliser is computed by every form for free by appending a column of
ones to v, so each form only has to implement ``y = causal(phi(q), phi(k), v) + phi(q) @ S0`` and
return the final state; numerator, denominator and (S, z) are then the columns of one result.

Modules: ``api`` (``linear_attention``), ``forms`` (the six forms), ``chunked`` (the fast one, with
its hand-derived backward and the fused CPU kernel's binding), ``step`` (decoding), ``reference``
(float64, for tests), ``checks`` (arguments and states).
"""
from .api import linear_attention
from .checks import State
from .forms import FORMS
from .reference import linear_attention_reference
from .step import linear_attention_step

__all__ = ["FORMS", "State", "linear_attention", "linear_attention_reference", "linear_attention_step"]
