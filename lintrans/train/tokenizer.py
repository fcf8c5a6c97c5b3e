"""The tokenizers, re-exported from ``lintrans.tokenizer`` (their home below the model and training
layers, so that sampling needs nothing from training)."""
from lintrans.tokenizer import (  # noqa: F401
    GPT2_EOT,
    GPT2_PATTERN,
    GPT2_RANKS_SHA256,
    TOKENIZERS,
    ByteTokenizer,
    GPT2Tokenizer,
    _load_gpt2_ranks,
    get_tokenizer,
)
