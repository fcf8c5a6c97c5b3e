"""GPTConfig: every architectural choice of the model, serialisable to JSON."""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any, Optional

from lintrans.checks import check_choice, check_known_keys
from lintrans.config import check_fields

MLP_KINDS = ("gelu", "swiglu")
GELU_APPROXIMATIONS = ("tanh", "none")
POS_EMBEDDINGS = ("learned", "rope", "none")


class HeadGeometry:
    """Per-head sizes derived from ``n_embd``, ``n_head`` and ``n_kv_head`` (shared by the model
    config and the cost model's shape)."""

    n_embd: int
    n_head: int
    n_kv_head: Optional[int]

    @property
    def head_dim(self) -> int:
        return self.n_embd // self.n_head

    @property
    def kv_heads(self) -> int:
        return self.n_head if self.n_kv_head is None else self.n_kv_head


@dataclass
class GPTConfig(HeadGeometry):
    """GPT-2 / nanoGPT hyper-parameters plus the attention mechanism and a few modern options.

    attention: a name from ``lintrans.nn.available_attention()`` (``softmax``, ``linear``, ...);
    attention_options: that mechanism's options (for ``linear``: feature_map, feature_map_options,
    form, chunk_size, normalize, scale, eps). n_kv_head: key/value heads for grouped-query (None =
    n_head, 1 = multi-query). gelu_approximate: ``tanh`` is GPT-2's GELU (Hugging Face parity),
    ``none`` the exact erf GELU nanoGPT uses. pos_embedding: ``learned`` is GPT-2's position table;
    ``rope`` rotates the queries and keys of mechanisms that support it (``lintrans.nn.rotary``; no
    table, so the context is not limited by block_size); ``none`` uses no positions at all (then
    context length is not limited by block_size for mechanisms that do not need it).
    reversible: the Reformer's reversible residual layers (two streams, activations recomputed in
    the backward pass, so their memory does not grow with n_layer); the same parameters as the
    ordinary GPT, a different function of them (``lintrans.models.reversible``).
    """

    n_layer: int = field(default=12, metadata={"help": "transformer blocks", "low": 1})
    n_head: int = field(default=12, metadata={"help": "attention heads per block", "low": 1})
    n_embd: int = field(default=768, metadata={"help": "width of the residual stream, a multiple of n_head", "low": 1})
    block_size: int = field(default=1024, metadata={"help": "longest context (the size of the learned position "
                                                             "table)", "low": 1})
    vocab_size: int = field(default=50304, metadata={"help": "tokens in the vocabulary (a training run takes its "
                                                              "tokenizer's unless set)", "low": 1})
    bias: bool = field(default=True, metadata={"help": "biases in the linear layers and layer norms"})
    dropout: float = field(default=0.0, metadata={"help": "dropout probability", "low": 0, "high": 1,
                                                  "high_open": True})
    attention: str = field(default="softmax", metadata={
        "help": "the mechanism, a name from lintrans.nn.available_attention() (softmax, linear, ...)"})
    attention_options: dict = field(default_factory=dict, metadata={
        "help": "that mechanism's options, e.g. {feature_map: elu, chunk_size: 64} for linear"})
    n_kv_head: Optional[int] = field(default=None, metadata={
        "help": "key/value heads for grouped-query attention (default: n_head; 1 = multi-query)", "low": 1})
    mlp: str = field(default="gelu", metadata={"help": "the feed-forward block", "choices": MLP_KINDS})
    gelu_approximate: str = field(default="tanh", metadata={
        "help": "tanh is GPT-2's GELU, none the exact erf GELU of nanoGPT", "choices": GELU_APPROXIMATIONS})
    gradient_checkpointing: bool = field(default=False, metadata={
        "help": "recompute each block in the backward pass: less memory, more time"})
    pos_embedding: str = field(default="learned", metadata={
        "help": f"one of {list(POS_EMBEDDINGS)}: learned is GPT-2's table; rope rotates q and k (softmax only); "
                "none drops positions (the context is then not limited by block_size where the mechanism needs none)"})
    reversible: bool = field(default=False, metadata={
        "help": "the Reformer's reversible residual layers: activation memory flat in n_layer"})

    def __post_init__(self) -> None:
        check_fields(self, label=lambda key: f"GPTConfig.{key}")  # each key against its field's limits
        if self.n_embd % self.n_head:
            raise ValueError(f"GPTConfig.n_embd ({self.n_embd}) must be divisible by n_head ({self.n_head})")
        if self.n_kv_head is not None and self.n_head % self.n_kv_head:
            raise ValueError(f"GPTConfig.n_head ({self.n_head}) must be divisible by n_kv_head ({self.n_kv_head})")
        if self.reversible and self.gradient_checkpointing:
            raise ValueError("GPTConfig.reversible already recomputes every block in the backward pass: "
                             "gradient_checkpointing must be False with it")
        check_choice("GPTConfig.pos_embedding", self.pos_embedding, POS_EMBEDDINGS)
        if self.pos_embedding == "rope":
            if self.head_dim % 2:
                raise ValueError(f"GPTConfig.pos_embedding='rope' needs an even head_dim (n_embd / n_head), "
                                 f"got {self.head_dim}")
            if self.reversible:
                raise ValueError("GPTConfig.pos_embedding='rope' is not supported with reversible=True")

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "GPTConfig":
        if not isinstance(d, dict):
            raise TypeError(f"GPTConfig.from_dict needs a dict, got {type(d).__name__}")
        check_known_keys("GPTConfig keys", d, [f.name for f in dataclasses.fields(cls)])
        return cls(**d)

    def replace(self, **changes) -> "GPTConfig":
        return self.from_dict({**self.to_dict(), **changes})
