"""Models for the experiments: attention specs, the GPT config a study builds from one, the GPT's
blocks between a linear read-in and read-out of vectors (regression), and per-layer state sizes."""
from __future__ import annotations

import torch
import torch.nn as nn

from lintrans.checks import check_choice
from lintrans.models.config import GPTConfig
from lintrans.models.gpt import GPT
from lintrans.nn.registry import available_attention


def _option_value(text: str):
    for cast in (int, float):
        try:
            return cast(text)
        except ValueError:
            pass
    return {"true": True, "false": False}.get(text.lower(), text)


def parse_attention(spec: str) -> tuple[str, dict]:
    """``softmax`` | ``linear:based`` (feature map) | ``NAME:key=value,...`` -> (attention, attention_options)."""
    if not isinstance(spec, str) or not spec:
        raise ValueError(f"attention spec must be a non-empty string such as 'softmax' or 'linear:elu', got {spec!r}")
    name, _, rest = spec.partition(":")
    check_choice(f"attention spec {spec!r}: attention", name, available_attention())
    options: dict = {}
    if rest and "=" not in rest:
        if name != "linear":
            raise ValueError(f"attention spec {spec!r}: a bare option (feature map) is only for 'linear'; "
                             "use NAME:key=value,... for other options")
        from lintrans.nn.attention import feature_map_names

        check_choice(f"attention spec {spec!r}: feature map", rest, feature_map_names())
        options["feature_map"] = rest
    elif rest:
        for item in rest.split(","):
            key, eq, value = item.partition("=")
            if not eq or not key:
                raise ValueError(f"attention spec {spec!r}: options must be key=value, got {item!r}")
            options[key] = _option_value(value)
    return name, options


def gpt_config(spec: str, *, linear_form: str = "chunked", **fields) -> GPTConfig:
    """The GPTConfig of an attention spec; mechanisms with a linear-attention ``form`` get
    ``linear_form`` unless the spec sets one. Building the model once checks the options (a bad spec fails before any training)."""
    import dataclasses

    from lintrans.nn.registry import get_attention

    name, options = parse_attention(spec)
    form = {f.name: f for f in dataclasses.fields(get_attention(name).Options)}.get("form")
    # linear and its gated kin; a mechanism whose forms are others (the delta rule's) keeps its default
    if form is not None and linear_form in form.metadata.get("choices", (linear_form,)):
        options.setdefault("form", linear_form)
    config = GPTConfig(dropout=0.0, attention=name, attention_options=options, **fields)
    return config


def check_specs(specs, **fields) -> None:
    """Every spec parses and builds a GPT layer with ``fields`` (ValueError/TypeError otherwise)."""
    if not isinstance(specs, (list, tuple)) or not specs or not all(isinstance(s, str) for s in specs):
        raise TypeError(f"mechanisms must be a non-empty list of attention specs, got {specs!r}")
    if len(set(specs)) != len(specs):
        raise ValueError(f"mechanisms must be distinct, got {list(specs)}")
    from lintrans.nn.registry import get_attention

    for spec in specs:
        config = gpt_config(spec, **fields)
        try:
            get_attention(config.attention)(config)
        except (ValueError, TypeError) as e:
            raise ValueError(f"attention spec {spec!r}: {e}") from None


def state_floats(model: GPT, seq_len: int) -> float:
    """Floats one layer keeps to continue a sequence of ``seq_len`` tokens (batch 1): the KV cache of
    softmax, the recurrent state of linear and gated attention, the ring buffer of a sliding window;
    measured from the model's own generation cache, averaged over layers."""
    model.eval()
    idx = torch.zeros(1, seq_len, dtype=torch.int64, device=next(model.parameters()).device)
    with torch.no_grad():
        _, cache = model.forward_cached(idx)
    return cache.nbytes() / 4 / model.config.n_layer  # float32


class VectorGPT(nn.Module):
    """x [B, T, in_dim] -> [B, T, out_dim]: a linear read-in in place of the token embedding, the
    GPT's positions (if any), blocks and final LayerNorm (``GPT.hidden(inputs_embeds=...)``), and a
    linear read-out."""

    def __init__(self, config: GPTConfig, in_dim: int, out_dim: int = 1):
        super().__init__()
        self.gpt = GPT(config.replace(vocab_size=1))
        del self.gpt.transformer["wte"]  # token embedding and (tied) head: unused with inputs_embeds
        self.gpt.lm_head = None
        self.config = self.gpt.config
        self.read_in = nn.Linear(in_dim, config.n_embd)
        self.read_out = nn.Linear(config.n_embd, out_dim)
        for layer in (self.read_in, self.read_out):
            GPT.init_weights(layer)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not isinstance(x, torch.Tensor) or x.dim() != 3 or x.shape[-1] != self.read_in.in_features:
            raise ValueError(f"x must be a tensor [B, T, {self.read_in.in_features}], got {getattr(x, 'shape', x)}")
        return self.read_out(self.gpt.hidden(inputs_embeds=self.read_in(x)))  # [B,T,out_dim]
