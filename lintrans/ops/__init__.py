"""Pure functions on [B, T, H, D] tensors, each with a plain reference beside it."""
from .feature_maps import FEATURE_MAPS, resolve_feature_map
from .linear import FORMS, linear_attention, linear_attention_reference, linear_attention_step
from .softmax import softmax_attention, softmax_attention_reference

__all__ = [
    "FEATURE_MAPS",
    "FORMS",
    "linear_attention",
    "linear_attention_reference",
    "linear_attention_step",
    "resolve_feature_map",
    "softmax_attention",
    "softmax_attention_reference",
]
