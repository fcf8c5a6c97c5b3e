"""GPT-2 as in nanoGPT (pre-LayerNorm blocks, learned positions, tied embeddings, GELU MLP, scaled
init of residual projections) with the attention layer chosen by name from the registry."""
from __future__ import annotations

import math
from typing import Iterator, Optional

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

from lintrans.nn.registry import get_attention
from lintrans.ops.cross_entropy import linear_cross_entropy
from lintrans.ops.validation import reads_values

from .config import GPTConfig
from .reversible import reversible_blocks, reversible_step


def swiglu_hidden(n_embd: int) -> int:
    """SwiGLU's hidden width: 2/3 of 4x, so that its three matrices cost what GELU's two do, rounded up to 8."""
    return 8 * ((8 * n_embd // 3 + 7) // 8)


class MLP(nn.Module):
    """GPT-2's 4x GELU MLP, or a gated SwiGLU one with about the same parameter count."""

    def __init__(self, config: GPTConfig):
        super().__init__()
        self.kind = config.mlp
        if config.mlp == "gelu":
            hidden = 4 * config.n_embd
            self.c_fc = nn.Linear(config.n_embd, hidden, bias=config.bias)
            self.act = nn.GELU(approximate=config.gelu_approximate)
        else:
            hidden = swiglu_hidden(config.n_embd)
            self.c_fc = nn.Linear(config.n_embd, 2 * hidden, bias=config.bias)  # gate and value
        self.c_proj = nn.Linear(hidden, config.n_embd, bias=config.bias)
        self.dropout = nn.Dropout(config.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.c_fc(x)
        if self.kind == "gelu":
            h = self.act(h)
        else:
            gate, value = h.chunk(2, dim=-1)
            h = F.silu(gate) * value
        return self.dropout(self.c_proj(h))


class Block(nn.Module):
    def __init__(self, config: GPTConfig):
        super().__init__()
        self.ln_1 = nn.LayerNorm(config.n_embd, bias=config.bias)
        self.attn = get_attention(config.attention)(config)
        self.ln_2 = nn.LayerNorm(config.n_embd, bias=config.bias)
        self.mlp = MLP(config)

    def attend(self, x: torch.Tensor, cache=None, use_cache: bool = False, rope=None):
        """The attention half of the block, without its residual: (attn(ln_1(x)), cache). ``rope``:
        the rotary tables (cos, sin) of x's positions, passed only to mechanisms that take them."""
        if rope is None:
            return self.attn(self.ln_1(x), cache=cache, use_cache=use_cache)
        return self.attn(self.ln_1(x), cache=cache, use_cache=use_cache, rope=rope)

    def feed(self, x: torch.Tensor) -> torch.Tensor:
        """The MLP half, without its residual: mlp(ln_2(x))."""
        return self.mlp(self.ln_2(x))

    def forward(self, x: torch.Tensor, cache=None, use_cache: bool = False, rope=None):
        a, cache = self.attend(x, cache=cache, use_cache=use_cache, rope=rope)
        x = x + a
        return x + self.feed(x), cache


class GenerationCache:
    """Per-layer caches (KV cache, recurrent state, ...) and how many tokens they cover."""

    def __init__(self, n_layer: int):
        self.layers: list = [None] * n_layer
        self.length = 0

    def nbytes(self) -> int:
        return cache_nbytes(self.layers)


def cache_nbytes(obj) -> int:
    """Bytes of tensors held by a cache: tensors, sequences, dicts, objects with ``nbytes()``."""
    if obj is None:
        return 0
    if isinstance(obj, torch.Tensor):
        return obj.numel() * obj.element_size()
    if hasattr(obj, "nbytes") and callable(obj.nbytes):
        return int(obj.nbytes())
    if isinstance(obj, dict):
        return sum(cache_nbytes(v) for v in obj.values())
    if isinstance(obj, (list, tuple)):
        return sum(cache_nbytes(v) for v in obj)
    return sum(cache_nbytes(v) for v in vars(obj).values()) if hasattr(obj, "__dict__") else 0


class GPT(nn.Module):
    def __init__(self, config: GPTConfig):
        super().__init__()
        if not isinstance(config, GPTConfig):
            raise TypeError(f"config must be a GPTConfig, got {type(config).__name__}")
        attention = get_attention(config.attention)  # unknown name -> ValueError listing the registered ones
        if config.pos_embedding == "rope" and not getattr(attention, "ROPE", False):
            from lintrans.nn.registry import rope_attention

            raise ValueError(f"pos_embedding='rope' rotates queries and keys before a dot-product softmax; attention "
                             f"{config.attention!r} does not take it (it works with {rope_attention()}); use "
                             "pos_embedding='none' or 'learned' with this mechanism")
        self.config = config
        self.context_parallel = None  # (group, rank, size): set_context_parallel
        layers = dict(
            wte=nn.Embedding(config.vocab_size, config.n_embd),
            drop=nn.Dropout(config.dropout),
            h=nn.ModuleList([Block(config) for _ in range(config.n_layer)]),
            ln_f=nn.LayerNorm(config.n_embd, bias=config.bias),
        )
        if config.pos_embedding == "learned":
            layers["wpe"] = nn.Embedding(config.block_size, config.n_embd)
        self.transformer = nn.ModuleDict(layers)
        self.lm_head = nn.Linear(config.n_embd, config.vocab_size, bias=False)
        self.transformer.wte.weight = self.lm_head.weight  # tied, as in GPT-2
        self.apply(self.init_weights)
        # residual projections scaled by 1/sqrt(2 * n_layer) (GPT-2 paper)
        for name, p in self.named_parameters():
            if name.endswith("c_proj.weight"):
                nn.init.normal_(p, mean=0.0, std=0.02 / math.sqrt(2 * config.n_layer))

    @staticmethod
    def init_weights(module: nn.Module) -> None:
        if isinstance(module, nn.Linear):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)
            if module.bias is not None:
                nn.init.zeros_(module.bias)
        elif isinstance(module, nn.Embedding):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)

    def set_context_parallel(self, group) -> None:
        """Split every sequence over the ranks of ``group`` (a torch.distributed ProcessGroup; None:
        off): each rank then passes its contiguous slice of the tokens, in rank order, with positions
        offset to match, and the attention layers exchange their states (``lintrans.ops.context_parallel``).
        Only mechanisms whose class sets ``CONTEXT_PARALLEL`` can; others raise a ValueError naming them."""
        if group is not None:
            import torch.distributed as dist

            from lintrans.nn.registry import context_parallel_attention

            if not all(getattr(b.attn, "CONTEXT_PARALLEL", False) for b in self.transformer.h):
                raise ValueError(f"attention {self.config.attention!r} cannot split a sequence over processes; "
                                 f"context parallelism works with {context_parallel_attention()}")
            group = (group, dist.get_rank(group), dist.get_world_size(group))
        self.context_parallel = group
        for block in self.transformer.h:
            if getattr(block.attn, "CONTEXT_PARALLEL", False):
                block.attn.context_parallel = None if group is None else group[0]

    def get_num_params(self, non_embedding: bool = True) -> int:
        """Parameter count; by default without the position embedding (nanoGPT's convention:
        the token embedding counts, being the output layer too)."""
        n = sum(p.numel() for p in self.parameters())
        if non_embedding and "wpe" in self.transformer:
            n -= self.transformer.wpe.weight.numel()
        return n

    # -- forward -------------------------------------------------------------------------------

    def position_limit(self) -> Optional[int]:
        """The longest sequence the model covers: block_size with learned positions, a layer's own limit
        (AFT-full/local's pairwise bias, cosFormer's max_len), else None (any length)."""
        limits = [self.config.block_size] if self.config.pos_embedding == "learned" else []
        limits += [b.attn.max_positions for b in self.transformer.h if getattr(b.attn, "max_positions", None)]
        return min(limits) if limits else None

    def _check_length(self, length: int) -> None:
        limit = self.position_limit()
        if limit is None or length <= limit:
            return
        if self.config.pos_embedding == "learned" and limit == self.config.block_size:
            raise ValueError(f"sequence length {length} exceeds block_size {limit} (learned position embeddings "
                             "cover positions 0..block_size-1)")
        raise ValueError(f"sequence length {length} exceeds {limit}, the positions attention {self.config.attention!r} "
                         "has parameters for (its max_positions: block_size, or an option such as max_len)")

    def _check_idx(self, idx, past: int, check_ids: bool = True) -> None:
        if not isinstance(idx, torch.Tensor) or idx.dtype not in (torch.int64, torch.int32):
            got = getattr(idx, "dtype", type(idx).__name__)
            raise TypeError(f"idx must be an int64 (or int32) tensor of token ids [B, T], got {got}")
        if idx.dim() != 2 or idx.shape[1] < 1:
            raise ValueError(f"idx must have shape [B, T] with T >= 1, got {tuple(idx.shape)}")
        self._check_length(past + idx.shape[1])
        # the id range is read back only on the CPU: on an accelerator it would be a host sync per
        # forward, and there an out-of-range id fails in the embedding, on the device
        if (check_ids and reads_values(idx.device) and idx.numel()
                and (int(idx.min()) < 0 or int(idx.max()) >= self.config.vocab_size)):
            raise ValueError(
                f"token ids must be in [0, {self.config.vocab_size - 1}] (vocab_size {self.config.vocab_size}), "
                f"got min {int(idx.min())} max {int(idx.max())}"
            )

    def _check_targets(self, targets, idx) -> None:
        if not isinstance(targets, torch.Tensor) or targets.dtype not in (torch.int64, torch.int32):
            got = getattr(targets, "dtype", type(targets).__name__)
            raise TypeError(f"targets must be an int64 (or int32) tensor of token ids [B, T], got {got}")
        if targets.shape != idx.shape:  # idx: already checked
            raise ValueError(f"targets must have the shape of idx {tuple(idx.shape)}, got {tuple(targets.shape)}")
        if reads_values(targets.device):  # as for idx: on an accelerator the loss asserts on the device
            bad = (targets != -1) & ((targets < 0) | (targets >= self.config.vocab_size))
            if bool(bad.any()):
                raise ValueError(f"targets must lie in [0, {self.config.vocab_size - 1}] (vocab_size "
                                 f"{self.config.vocab_size}) or equal -1 (ignored), got {int(targets[bad][0])}")

    def hidden(self, idx: Optional[torch.Tensor] = None, *, inputs_embeds: Optional[torch.Tensor] = None) -> torch.Tensor:
        """The final hidden states [B, T, C] (after ``ln_f``, before the head), from token ids or
        from ``inputs_embeds`` [B, T, C] given in place of the token embedding (positions are still
        added): the entry for models that read vectors or mix extra inputs into the embedding."""
        if (idx is None) == (inputs_embeds is None):
            raise ValueError("pass exactly one of idx and inputs_embeds")
        return self._hidden(idx, None, inputs_embeds=inputs_embeds)

    def _hidden(self, idx: Optional[torch.Tensor], cache: Optional[GenerationCache], check_ids: bool = True,
                inputs_embeds: Optional[torch.Tensor] = None) -> torch.Tensor:
        past = 0 if cache is None else cache.length
        if self.context_parallel is not None:  # this rank holds tokens [rank * T, (rank + 1) * T) of each sequence
            if cache is not None:
                raise NotImplementedError("generation with a context-parallel model: call set_context_parallel(None)")
            past = self.context_parallel[1] * (idx if inputs_embeds is None else inputs_embeds).shape[1]
        if inputs_embeds is None:
            self._check_idx(idx, past, check_ids)
            x = self.transformer.wte(idx)  # [B,T,C]
        else:
            x = inputs_embeds
            if not isinstance(x, torch.Tensor) or x.dim() != 3 or x.shape[-1] != self.config.n_embd or x.shape[1] < 1:
                raise ValueError(f"inputs_embeds must be a tensor [B, T, {self.config.n_embd}] with T >= 1, "
                                 f"got {tuple(getattr(x, 'shape', ()))}")
            self._check_length(past + x.shape[1])
        T = x.shape[1]
        rope = None
        if "wpe" in self.transformer:
            pos = torch.arange(past, past + T, device=x.device)
            x = x + self.transformer.wpe(pos)
        elif self.config.pos_embedding == "rope":
            from lintrans.nn.rotary import rope_tables

            rope = rope_tables(torch.arange(past, past + T, device=x.device), self.config.head_dim,
                               dtype=torch.promote_types(x.dtype, torch.float32))
        x = self.transformer.drop(x)
        if self.config.reversible:
            x = self._reversible(x, cache)
        else:
            for i, block in enumerate(self.transformer.h):
                if cache is not None:
                    x, cache.layers[i] = block(x, cache=cache.layers[i], use_cache=True, rope=rope)
                elif self.config.gradient_checkpointing and self.training and torch.is_grad_enabled():
                    x, _ = checkpoint(block, x, None, False, rope, use_reentrant=False)
                else:
                    x, _ = block(x, rope=rope)
        if cache is not None:
            cache.length = past + T
        return self.transformer.ln_f(x)

    def _reversible(self, x: torch.Tensor, cache: Optional[GenerationCache]) -> torch.Tensor:
        """The blocks as reversible layers: the embedding goes into both streams, and their mean
        into ``ln_f`` (so the parameters are the ordinary GPT's, and the head stays tied)."""
        x1 = x2 = x
        if cache is not None:
            for i, block in enumerate(self.transformer.h):
                x1, x2, cache.layers[i] = reversible_step(block, x1, x2, cache.layers[i], use_cache=True)
        else:
            x1, x2 = reversible_blocks(self.transformer.h, x1, x2,
                                       replay_rng=self.training and self.config.dropout > 0)
        return (x1 + x2) / 2

    def forward(self, idx: torch.Tensor, targets: Optional[torch.Tensor] = None, *, return_logits: bool = True):
        """idx [B, T] token ids -> (logits [B, T, V] for every position, mean cross-entropy or None).

        Targets equal to -1 are ignored in the loss (nanoGPT's convention for padding). With
        targets and ``return_logits=False`` the logits are never built: the loss (and, under
        autograd, its gradient) comes from ``linear_cross_entropy`` chunk by chunk, which at long
        context saves gigabytes (T x vocab floats, twice) and returns (None, loss).
        """
        if not return_logits and targets is None:
            raise ValueError("return_logits=False needs targets (without them the logits are the only output)")
        h = self._hidden(idx, None)  # [B,T,C]; checks idx first
        if targets is not None:
            self._check_targets(targets, idx)
        if not return_logits:
            w = self.lm_head.weight
            hf = h.flatten(0, 1)
            kind = h.device.type
            if torch.amp.is_autocast_available(kind) and torch.is_autocast_enabled(kind):  # the head in its dtype
                dtype = torch.get_autocast_dtype(kind)
                hf, w = hf.to(dtype), w.to(dtype)
            return None, linear_cross_entropy(hf, w, targets.flatten(), ignore_index=-1)
        logits = self.lm_head(h)  # [B,T,V]
        loss = None
        if targets is not None:
            acc = torch.promote_types(logits.dtype, torch.float32)  # float32 at least, float64 kept
            loss = F.cross_entropy(logits.flatten(0, 1).to(acc), targets.flatten().long(), ignore_index=-1)
        return logits, loss

    def forward_cached(
        self, idx: torch.Tensor, cache: Optional[GenerationCache] = None, last_only: bool = False,
        check_ids: bool = True,
    ):
        """Incremental forward for generation: idx [B, T] continues the tokens ``cache`` covers.

        Returns (logits [B, T or 1, V], cache); the cache is updated in place and also returned.
        A prompt is one call (prefill); decoding is one call per token. ``check_ids=False`` skips
        the token-range check (a device sync) for ids the model sampled itself.
        """
        if cache is None:
            cache = GenerationCache(self.config.n_layer)
        h = self._hidden(idx, cache, check_ids)
        if last_only:
            h = h[:, -1:]
        return self.lm_head(h), cache

    # -- generation ----------------------------------------------------------------------------

    @torch.no_grad()
    def generate_stream(
        self,
        idx: torch.Tensor,
        max_new_tokens: int,
        temperature: float = 1.0,
        top_k: Optional[int] = None,
        top_p: Optional[float] = None,
        seed: Optional[int] = None,
        vocab_limit: Optional[int] = None,
        eos_token_id: Optional[int] = None,
    ) -> Iterator[torch.Tensor]:
        """Yield each new token [B, 1] as it is produced (prefill once, then one step per token).

        ``vocab_limit``: sample only ids below it, e.g. the tokenizer's size when the embedding is
        padded past it (GPT-2's 50257 tokens in a 50304-row table, bytes' 257 in 320): a padding id
        has no text, and an undertrained model gives it real probability.

        ``eos_token_id`` (as Hugging Face's): a row that produced it yields it again from then on, and
        generation stops once every row has (so fewer than ``max_new_tokens`` may come).

        ``seed``: one generator for the whole batch, so a row's draws depend on its place in the batch
        (not on the other rows' prompts). Every prompt of a batch has the same length: there is no
        padding or attention mask.

        With learned positions a model has no position past ``block_size - 1`` (nor has AFT-full/local's
        pairwise bias, or cosFormer past its ``max_len``: ``position_limit``); once the sequence would
        outgrow it, each next token is predicted from the last ``block_size`` tokens alone (a fresh
        prefill of that window per token), as nanoGPT's ``generate`` crops its context. Otherwise
        nothing is cropped: recurrent mechanisms keep their constant-size state and softmax its
        growing cache.
        """
        from lintrans.checks import check_number

        from .generate import check_sampling, sample_next

        check_sampling(max_new_tokens, temperature, top_k, top_p, seed)
        check_number("vocab_limit", vocab_limit, integer=True, low=1, high=self.config.vocab_size, allow_none=True)
        check_number("eos_token_id", eos_token_id, integer=True, low=0, high=self.config.vocab_size - 1,
                     allow_none=True)
        if not isinstance(idx, torch.Tensor) or idx.dim() != 2:
            self._check_idx(idx, 0)  # its clear error, before idx's device and length are read below
        window = self.position_limit()
        generator = None
        if seed is not None:
            generator = torch.Generator(device=idx.device).manual_seed(seed)
        modes = [(m, m.training) for m in self.modules()]  # each module's own: a user may have set some
        self.eval()
        try:
            if window is not None and idx.shape[1] > window:
                idx = idx[:, -window:]  # a prompt longer than the model's positions: its last window
            logits, cache = self.forward_cached(idx, None, last_only=True)
            tail = idx  # the last `window` tokens, kept only while cropping can happen
            done = None  # [B,1] rows that produced eos_token_id
            for i in range(max_new_tokens):
                nxt = sample_next(logits[:, -1, :vocab_limit], temperature, top_k, top_p, generator)  # [B,1]
                if eos_token_id is not None:
                    if done is not None:
                        nxt = nxt.masked_fill(done, eos_token_id)
                    done = nxt == eos_token_id if done is None else done | (nxt == eos_token_id)
                yield nxt
                if i + 1 == max_new_tokens or (done is not None and bool(done.all())):
                    break
                if window is not None and cache.length + 1 > window:
                    tail = torch.cat([tail, nxt], dim=1)[:, -window:]  # [B,window]
                    logits, cache = self.forward_cached(tail, None, last_only=True, check_ids=False)
                else:
                    if window is not None:
                        tail = torch.cat([tail, nxt], dim=1)
                    logits, cache = self.forward_cached(nxt, cache, check_ids=False)
        finally:
            for m, training in modes:
                m.training = training

    @torch.no_grad()
    def generate(
        self,
        idx: torch.Tensor,
        max_new_tokens: int,
        temperature: float = 1.0,
        top_k: Optional[int] = None,
        top_p: Optional[float] = None,
        seed: Optional[int] = None,
        vocab_limit: Optional[int] = None,
        eos_token_id: Optional[int] = None,
    ) -> torch.Tensor:
        """idx [B, T] -> [B, T + max_new_tokens] (fewer new tokens where every row reached
        ``eos_token_id``; rows that reached it earlier are filled with it). Greedy when temperature is
        0; ``vocab_limit``, ``eos_token_id`` and ``seed`` as in ``generate_stream``."""
        new = list(self.generate_stream(idx, max_new_tokens, temperature, top_k, top_p, seed, vocab_limit,
                                        eos_token_id))
        return torch.cat([idx, *new], dim=1)

    # -- weights -------------------------------------------------------------------------------

    @classmethod
    def from_pretrained(cls, name_or_path: str = "gpt2", **overrides) -> "GPT":
        """GPT-2 weights from a local folder or the local Hugging Face cache (never downloads).

        overrides may change what keeps every weight valid: attention, attention_options (e.g.
        ``attention="linear"`` to linearise), dropout, gradient_checkpointing, gelu_approximate.
        """
        from .hf import from_pretrained

        return from_pretrained(name_or_path, **overrides)
