"""The benchmark model sizes, and what each means: its GPT config, the chunk size a run at context
T uses, the feature dimension of a linear map on its heads and its cost-model shape (``ModelSize``).
Torch-free at import, so that `lintrans cost --size` loads fast."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

VOCAB = 50257
# name -> (n_layer, n_head, n_embd); head dim 64 throughout, as in GPT-2
SIZES = {
    "4L-128": (4, 2, 128),  # the quick profile: small enough that T = 8k fits the demo's minutes
    "12L-128": (12, 2, 128),  # the demo: deep and narrow so attention, not the LM head, sets the pace
    "2L-256": (2, 4, 256),
    "6L-384": (6, 6, 384),
    # attention-heavy: deep and narrow, so the T^2 term outweighs the 50257-wide LM head sooner
    "12L-256": (12, 4, 256),
    "12L-768": (12, 12, 768),  # GPT-2 124M
    # attention-dominated: the no-mixing bound grows with L T / V, so depth is what lets the
    # attention term outgrow the LM head at batch 1 (`lintrans cost --size 48L-128` shows the split)
    "48L-128": (48, 2, 128),
}

# other names accepted for a size: the shipped training config of the same shape (`lintrans train
# --config gpt2-124m`), and the long label older records and commands used
ALIASES = {"gpt2-124m": "12L-768", "12L-768 (GPT-2 124M)": "12L-768", "gpt2": "12L-768"}

DEFAULT_CHUNK = 64  # where a run does not tune it (the prefill of the generation benchmark, non-chunked forms)


def resolve_size(name: str, flag: str = "--size") -> str:
    """The canonical size name for ``name`` (a key of SIZES or an alias); ValueError naming ``flag``."""
    if name in SIZES:
        return name
    if name in ALIASES:
        return ALIASES[name]
    raise ValueError(f"{flag} must be one of {list(SIZES)} (or {list(ALIASES)}), got {name!r}")


def feature_dim_of(feature_map, head_dim: int) -> int:
    """Width of ``feature_map``'s output on heads of ``head_dim`` (e.g. elu: head_dim)."""
    import torch

    from lintrans.ops import resolve_feature_map

    phi_q, _ = resolve_feature_map(feature_map)
    return phi_q(torch.zeros(1, head_dim)).shape[-1]


def is_linear(attention: str) -> bool:
    """Whether the mechanism is a linear-attention layer (takes form and chunk_size options)."""
    from lintrans.nn.attention import LinearAttention
    from lintrans.nn.registry import get_attention

    return issubclass(get_attention(attention), LinearAttention)


def is_gated(attention: str) -> bool:
    """Whether the mechanism decays its state (overrides ``LinearAttention.log_decay``)."""
    from lintrans.nn.attention import LinearAttention
    from lintrans.nn.registry import get_attention

    return is_linear(attention) and get_attention(attention).log_decay is not LinearAttention.log_decay


@dataclass(frozen=True)
class ModelSize:
    """One benchmark size: a GPT-2-style model (vocabulary ``VOCAB``, no dropout) of this depth and
    width, whose context and attention each run chooses."""

    name: str
    n_layer: int
    n_head: int
    n_embd: int
    vocab_size: int = VOCAB

    @property
    def head_dim(self) -> int:
        return self.n_embd // self.n_head

    def gpt_config(self, T: int, attention: str = "softmax", form: Optional[str] = None,
                   chunk_size: int = DEFAULT_CHUNK, **overrides):
        """The model a run at context ``T`` builds; ``form`` and ``chunk_size`` are the linear
        op's options (none when ``form`` is None)."""
        from lintrans.models import GPTConfig

        opts = {"form": form, "chunk_size": chunk_size} if form is not None else {}
        return GPTConfig(n_layer=self.n_layer, n_head=self.n_head, n_embd=self.n_embd, vocab_size=self.vocab_size,
                         block_size=T, dropout=0.0, attention=attention, attention_options=opts, **overrides)

    def chunk_size(self, T: int, attention: str, form: Optional[str], *, tuned: bool = True,
                   device: str = "cpu", feature_map: str = "elu") -> int:
        """The chunk size a run at ``T`` uses: the tuned one (``lintrans.ops.chunk_tuning``, cached
        per machine) for the chunked form, else ``DEFAULT_CHUNK``. The feature dimension of elu
        (= head_dim) stands for the identity map of the gated mechanisms' defaults alike."""
        if not (tuned and form == "chunked"):
            return DEFAULT_CHUNK
        import torch

        from lintrans.ops.chunk_tuning import auto_chunk_size

        return auto_chunk_size(T, self.head_dim, feature_dim_of(feature_map, self.head_dim), torch.float32, device,
                               gated=is_gated(attention))

    def shape(self, T: int, attention: str = "softmax", form: Optional[str] = None,
              chunk_size: int = DEFAULT_CHUNK, **overrides):
        """The cost model's ``ModelShape`` of ``gpt_config(...)``."""
        from .cost import ModelShape

        return ModelShape.from_config(self.gpt_config(T, attention, form, chunk_size, **overrides))


def model_size(name: str, flag: str = "--size") -> ModelSize:
    """The ``ModelSize`` named ``name`` (a key of SIZES or an alias); ValueError naming ``flag``."""
    name = resolve_size(name, flag)
    return ModelSize(name, *SIZES[name])
