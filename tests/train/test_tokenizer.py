import pytest

from lintrans.train.tokenizer import get_tokenizer

# ids produced by OpenAI's GPT-2 encoder
KNOWN_GPT2 = {
    "Hello world": [15496, 995],
    "hello world": [31373, 995],
    "Hello, world!": [15496, 11, 995, 0],
    " the": [262],
    "<|endoftext|>": [27, 91, 437, 1659, 5239, 91, 29],  # special-token text stays ordinary text
}
AWKWARD = ["", " ", "a", "  two  spaces\n\n\ttab", "naïve café – 東京 🙂", "it's they're we'll I'd", "1234567 3.14"]


def test_gpt2_matches_known_ids():
    tok = get_tokenizer("gpt2")
    assert (tok.vocab_size, tok.eot_token) == (50257, 50256)
    for text, ids in KNOWN_GPT2.items():
        assert tok.encode(text) == ids, text


@pytest.mark.parametrize("name", ["gpt2", "bytes"])
def test_round_trip(name):
    tok = get_tokenizer(name)
    for text in AWKWARD + list(KNOWN_GPT2):
        ids = tok.encode(text)
        assert all(0 <= i < tok.vocab_size and i != tok.eot_token for i in ids)
        assert tok.decode(ids) == text
    assert tok.encode_batch(AWKWARD) == [tok.encode(t) for t in AWKWARD]


def test_bytes_tokenizer():
    tok = get_tokenizer("bytes")
    assert (tok.vocab_size, tok.eot_token) == (257, 256)
    assert tok.encode("aé") == [97, 0xC3, 0xA9]
    assert tok.decode([104, 105, 256]) == "hi"  # end-of-text is not text


def test_bad_names_and_inputs():
    with pytest.raises(ValueError, match="tokenizer must be one of"):
        get_tokenizer("gpt3")
    with pytest.raises(TypeError, match="str"):
        get_tokenizer("gpt2").encode(b"bytes")
