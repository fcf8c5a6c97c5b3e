"""The delta rule (DeltaNet) and its gated form (Gated DeltaNet): ``delta_rule`` in a ``recurrent``
and a ``chunked`` form, ``delta_rule_step`` for decoding, ``delta_rule_reference`` in float64."""
from .api import DELTA_FORMS, delta_rule, delta_rule_step
from .context_parallel import context_parallel_delta_rule
from .reference import delta_rule_reference

__all__ = ["DELTA_FORMS", "context_parallel_delta_rule", "delta_rule", "delta_rule_reference", "delta_rule_step"]
