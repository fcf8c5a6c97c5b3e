"""Attention layers and other modules; mechanisms are looked up by name through the registry."""
from .registry import available_attention, get_attention, register_attention

__all__ = ["available_attention", "get_attention", "register_attention"]
