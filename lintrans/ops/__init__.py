"""Pure functions on [B, T, H, D] tensors, each with a plain reference beside it."""
from .aft import (
    aft,
    aft_last_row,
    aft_reference,
    aft_simple_state,
    aft_simple_step,
    aft_window_state,
    aft_window_step,
)
from .bigbird import bigbird_attention, bigbird_attention_reference, bigbird_mask
from .context_parallel import context_parallel_linear_attention
from .cosformer import CosformerState, cosformer_attention, cosformer_attention_reference, cosformer_step
from .cross_entropy import linear_cross_entropy, linear_cross_entropy_reference
from .delta import DELTA_FORMS, context_parallel_delta_rule, delta_rule, delta_rule_reference, delta_rule_step
from .feature_maps import FEATURE_MAPS, feature_dim_for, resolve_feature_map
from .linear import FORMS, linear_attention, linear_attention_reference, linear_attention_step
from .lsh import lsh_attention, lsh_attention_reference, lsh_buckets, lsh_mask, shared_qk_attention
from .sliding_window import (
    sliding_window_attention,
    sliding_window_attention_reference,
    sliding_window_cache,
    sliding_window_step,
)
from .softmax import softmax_attention, softmax_attention_reference
from .taylor import taylor_attention

__all__ = [
    "aft",
    "aft_last_row",
    "aft_reference",
    "aft_simple_state",
    "aft_simple_step",
    "aft_window_state",
    "aft_window_step",
    "bigbird_attention",
    "bigbird_attention_reference",
    "bigbird_mask",
    "CosformerState",
    "cosformer_attention",
    "cosformer_attention_reference",
    "cosformer_step",
    "context_parallel_delta_rule",
    "context_parallel_linear_attention",
    "DELTA_FORMS",
    "delta_rule",
    "delta_rule_reference",
    "delta_rule_step",
    "FEATURE_MAPS",
    "feature_dim_for",
    "linear_cross_entropy",
    "linear_cross_entropy_reference",
    "FORMS",
    "linear_attention",
    "linear_attention_reference",
    "linear_attention_step",
    "lsh_attention",
    "lsh_attention_reference",
    "lsh_buckets",
    "lsh_mask",
    "resolve_feature_map",
    "shared_qk_attention",
    "sliding_window_attention",
    "sliding_window_attention_reference",
    "sliding_window_cache",
    "sliding_window_step",
    "softmax_attention",
    "softmax_attention_reference",
    "taylor_attention",
]
