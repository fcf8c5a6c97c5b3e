"""Tokenizers that work offline: GPT-2 BPE from the shipped ranks file, and raw bytes.

Both expose ``name``, ``vocab_size``, ``eot_token``, ``encode(str) -> list[int]`` and
``decode(list[int]) -> str``. ``encode`` treats special-token text such as ``<|endoftext|>`` as
ordinary text, so arbitrary training data can never inject control tokens.
"""
from __future__ import annotations

import base64
import functools
import hashlib
from importlib import resources

from lintrans.checks import check_choice

TOKENIZERS = ("gpt2", "bytes")

# GPT-2's pre-tokenisation regex, as published with the GPT-2 encoder.
GPT2_PATTERN = r"""'(?:[sdmt]|ll|ve|re)| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"""
GPT2_EOT = 50256
# sha256 of lintrans/assets/gpt2.tiktoken (from the openai-whisper sdist, MIT licence).
GPT2_RANKS_SHA256 = "306cd27f03c1a714eca7108e03d66b7dc042abe8c258b44c199a7ed9838dd930"


class ByteTokenizer:
    """UTF-8 bytes as tokens 0..255, plus one end-of-text token 256."""

    name = "bytes"
    vocab_size = 257
    eot_token = 256

    def encode(self, text: str) -> list[int]:
        if not isinstance(text, str):
            raise TypeError(f"text must be a str, got {type(text).__name__}")
        return list(text.encode("utf-8"))

    def decode(self, tokens) -> str:
        return bytes(t for t in tokens if t < 256).decode("utf-8", errors="replace")

    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        return [self.encode(t) for t in texts]


class GPT2Tokenizer:
    """GPT-2's byte-level BPE (50257 tokens) through tiktoken, built from the shipped ranks file."""

    name = "gpt2"
    vocab_size = 50257
    eot_token = GPT2_EOT

    def __init__(self) -> None:
        import tiktoken

        self._enc = tiktoken.Encoding(
            name="gpt2",
            pat_str=GPT2_PATTERN,
            mergeable_ranks=_load_gpt2_ranks(),
            special_tokens={"<|endoftext|>": GPT2_EOT},
            explicit_n_vocab=self.vocab_size,
        )

    def encode(self, text: str) -> list[int]:
        if not isinstance(text, str):
            raise TypeError(f"text must be a str, got {type(text).__name__}")
        return self._enc.encode_ordinary(text)

    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        return self._enc.encode_ordinary_batch(texts, num_threads=2)

    def decode(self, tokens) -> str:
        return self._enc.decode(list(tokens), errors="replace")


def _load_gpt2_ranks() -> dict[bytes, int]:
    data = resources.files("lintrans.assets").joinpath("gpt2.tiktoken").read_bytes()
    digest = hashlib.sha256(data).hexdigest()
    if digest != GPT2_RANKS_SHA256:
        raise RuntimeError(
            f"lintrans/assets/gpt2.tiktoken is damaged (sha256 {digest}, expected {GPT2_RANKS_SHA256}); "
            "reinstall lintrans"
        )
    ranks = {}
    for line in data.splitlines():
        if line:
            token, rank = line.split()
            ranks[base64.b64decode(token)] = int(rank)
    return ranks


@functools.lru_cache(maxsize=None)
def get_tokenizer(name: str):
    """Return the tokenizer called ``name`` (one of ``TOKENIZERS``); cached, so cheap to call again."""
    check_choice("tokenizer", name, TOKENIZERS)
    return GPT2Tokenizer() if name == "gpt2" else ByteTokenizer()
