"""The benchmark model sizes (torch-free, so that `lintrans cost --size` loads fast)."""

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


def resolve_size(name: str, flag: str = "--size") -> str:
    """The canonical size name for ``name`` (a key of SIZES or an alias); ValueError naming ``flag``."""
    if name in SIZES:
        return name
    if name in ALIASES:
        return ALIASES[name]
    raise ValueError(f"{flag} must be one of {list(SIZES)} (or {list(ALIASES)}), got {name!r}")
