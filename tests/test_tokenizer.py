"""The vendored GPT-2 tokenizer: known ids, round trips, bytes, and no network."""

from __future__ import annotations

import hashlib
import socket

import pytest

from wafer_gpt2.model import tokenizer


def test_known_ids():
    assert tokenizer.encode("Hello world") == [15496, 995]
    assert tokenizer.encode(" the") == [262]
    assert tokenizer.EOT_ID == 50256
    assert tokenizer.get_encoding().n_vocab == tokenizer.VOCAB_SIZE == 50257
    assert tokenizer.encode("<|endoftext|>", allow_special=True) == [50256]


def test_split_pattern_is_gpt2s():
    # Contractions split off, a space glues to the following word, digits and letters separate.
    assert [tokenizer.decode([t]) for t in tokenizer.encode("I'll pay 42 dollars!!")] == [
        "I",
        "'ll",
        " pay",
        " 42",
        " dollars",
        "!!",
    ]


def test_special_text_in_prompts_is_not_a_control_token():
    ids = tokenizer.encode("a<|endoftext|>b")
    assert 50256 not in ids
    assert tokenizer.decode(ids) == "a<|endoftext|>b"


@pytest.mark.parametrize(
    "text", ["", "plain ascii", "naïve café 東京 🚀", "  leading and  double  spaces\n\ttabs"]
)
def test_round_trip(text):
    ids = tokenizer.encode(text)
    assert tokenizer.decode(ids) == text
    assert tokenizer.decode_bytes(ids) == text.encode()


def test_bytes_of_a_token_can_end_inside_a_character():
    ids = tokenizer.encode("🚀")
    assert len(ids) > 1  # the emoji is split over byte-level tokens
    pieces = [tokenizer.token_bytes(t) for t in ids]
    assert b"".join(pieces) == "🚀".encode()
    with pytest.raises(UnicodeDecodeError):
        pieces[0].decode("utf-8")


def test_vendored_file_is_the_published_one():
    assert hashlib.sha256(tokenizer.RANKS_FILE.read_bytes()).hexdigest() == tokenizer.RANKS_SHA256


def test_building_the_encoding_never_touches_the_network(monkeypatch, tmp_path):
    def refuse(*args, **kwargs):
        raise AssertionError("the tokenizer tried to open a network connection")

    monkeypatch.setattr(socket.socket, "connect", refuse)
    monkeypatch.setenv("TIKTOKEN_CACHE_DIR", str(tmp_path))  # no cached copy to fall back on
    tokenizer.get_encoding.cache_clear()
    try:
        assert tokenizer.encode("Hello world") == [15496, 995]
    finally:
        tokenizer.get_encoding.cache_clear()
