"""GPT-2's byte-pair tokenizer, built offline from the vendored `data/gpt2.tiktoken` ranks.

The ranks file is the one tiktoken publishes as `r50k_base`; with GPT-2's split pattern and the single
special token `<|endoftext|>` (id 50256) it reproduces GPT-2's tokenizer exactly. Nothing here touches
the network.
"""

from __future__ import annotations

from collections.abc import Iterable
from functools import cache
from pathlib import Path

import tiktoken
from tiktoken.load import load_tiktoken_bpe

RANKS_FILE = Path(__file__).parent / "data" / "gpt2.tiktoken"
RANKS_SHA256 = "306cd27f03c1a714eca7108e03d66b7dc042abe8c258b44c199a7ed9838dd930"

# GPT-2's pre-tokenizer regex (contractions, letters, numbers, other symbols, whitespace runs).
SPLIT_PATTERN = r"""'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"""

EOT_TEXT = "<|endoftext|>"
EOT_ID = 50256
VOCAB_SIZE = 50257


@cache
def get_encoding() -> tiktoken.Encoding:
    """The GPT-2 encoding (built once per process)."""
    ranks = load_tiktoken_bpe(str(RANKS_FILE), expected_hash=RANKS_SHA256)
    return tiktoken.Encoding(
        name="gpt2-vendored",
        pat_str=SPLIT_PATTERN,
        mergeable_ranks=ranks,
        special_tokens={EOT_TEXT: EOT_ID},
    )


def encode(text: str, allow_special: bool = False) -> list[int]:
    """Token ids of `text`. `<|endoftext|>` in the text is the EOT token only when `allow_special`;
    otherwise it is encoded as ordinary characters (prompts cannot inject control tokens)."""
    if allow_special:
        return get_encoding().encode(text, allowed_special="all")
    return get_encoding().encode_ordinary(text)


def encode_prompt(text: str) -> list[int]:
    """A prompt's ids as TGI and vLLM tokenize it with GPT-2's HF tokenizer (`<|endoftext|>` is an added
    token there, matched in any text): `<|endoftext|>` in the text is the EOT token, id 50256."""
    return encode(text, allow_special=True)


def decode(ids: Iterable[int]) -> str:
    """Text of `ids`; bytes that are not valid UTF-8 become U+FFFD."""
    return get_encoding().decode(list(ids))


def decode_bytes(ids: Iterable[int]) -> bytes:
    """The raw bytes of `ids` (a token may end inside a multi-byte UTF-8 character)."""
    return get_encoding().decode_bytes(list(ids))


@cache
def longest_token_chars() -> int:
    """The most characters one token stands for (66 for GPT-2): a text of C characters has at least
    C / longest_token_chars() tokens, so a prompt can be refused by its length before tokenizing it."""
    encoding = get_encoding()
    return max(len(encoding.decode([token])) for token in range(encoding.n_vocab))


@cache
def token_bytes(token: int) -> bytes:
    """The bytes of one token id (remembered: the engine asks for every generated token)."""
    return get_encoding().decode_single_token_bytes(token)


@cache
def whole_token_texts() -> tuple[str | None, ...]:
    """Per token id, its text when its bytes are whole UTF-8 characters, else None (it begins or ends
    inside a character): the detokenizer's fast path for every generated token. Built whole at the
    first call, so serving never grows it (a table that grew with the tokens seen would look like a leak)."""
    encoding = get_encoding()
    texts: list[str | None] = []
    for token in range(encoding.n_vocab):
        try:
            texts.append(encoding.decode_single_token_bytes(token).decode("utf-8"))
        except UnicodeDecodeError:
            texts.append(None)
    return tuple(texts)


def token_text(token: int) -> str | None:
    """One token's entry of `whole_token_texts`."""
    return whole_token_texts()[token]
