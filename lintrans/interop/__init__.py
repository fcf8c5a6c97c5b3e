"""Bridges to other libraries' models. Each submodule imports its library only when used:
``lintrans.interop.transformers`` runs Hugging Face transformers' Gated DeltaNet layers (Qwen3-Next and
its family) on ``lintrans.ops.delta_rule``."""
