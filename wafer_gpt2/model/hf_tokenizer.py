"""GPT-2's tokenizer as Hugging Face files (`vocab.json`, `merges.txt`, `tokenizer.json`,
`tokenizer_config.json`, `special_tokens_map.json`), built from the vendored tiktoken ranks.

Clients pointed at a model directory (guidellm, lm-eval, transformers' `AutoTokenizer`) load the
tokenizer from these files, so every model directory the project writes carries them, and then they
tokenize exactly like the server. The files are derived, not downloaded: the vocabulary is the ranks
(id = rank) in GPT-2's byte-to-unicode alphabet, and each multi-byte token's merge is the last step
of the byte-pair merge that makes it, found by running the merge on its bytes with the lower ranks
only; ordered by rank that is GPT-2's own `merges.txt` (50,000 merges).

`<|endoftext|>` is an added, special token: in text it is that one token, as with the HF tokenizer
vLLM and TGI load (and as the server's prompts treat it).
"""

from __future__ import annotations

import json
from functools import cache
from pathlib import Path

from wafer_gpt2.model import tokenizer

CONFIG_FILE = "tokenizer_config.json"
TOKENIZER_FILES = ("vocab.json", "merges.txt", "tokenizer.json", "special_tokens_map.json", CONFIG_FILE)

_EOT = tokenizer.EOT_TEXT
_ADDED_TOKEN = {
    "id": tokenizer.EOT_ID,
    "content": _EOT,
    "single_word": False,
    "lstrip": False,
    "rstrip": False,
    "normalized": True,
    "special": True,
}


def bytes_to_unicode() -> dict[int, str]:
    """GPT-2's printable stand-in for every byte (so that BPE strings have no spaces or controls)."""
    printable = [
        *range(ord("!"), ord("~") + 1),
        *range(ord("¡"), ord("¬") + 1),
        *range(ord("®"), ord("ÿ") + 1),
    ]
    mapping = {b: chr(b) for b in printable}
    extra = 0
    for b in range(256):
        if b not in mapping:
            mapping[b] = chr(256 + extra)
            extra += 1
    return mapping


def _last_merge(ranks: dict[bytes, int], token: bytes) -> tuple[bytes, bytes]:
    """The two parts tiktoken's byte-pair merge joins last to make `token` (ranks below its own only)."""
    limit = ranks[token]
    parts = [bytes([b]) for b in token]
    while len(parts) > 2:
        best, best_rank = -1, limit
        for i in range(len(parts) - 1):
            rank = ranks.get(parts[i] + parts[i + 1])
            if rank is not None and rank < best_rank:
                best, best_rank = i, rank
        if best < 0:
            raise ValueError(f"token {token!r} cannot be built by merges of lower rank")
        parts[best : best + 2] = [parts[best] + parts[best + 1]]
    return parts[0], parts[1]


@cache
def vocab_and_merges() -> tuple[dict[str, int], list[str]]:
    encoding = tokenizer.get_encoding()
    byte_chars = bytes_to_unicode()

    def text(token: bytes) -> str:
        return "".join(byte_chars[b] for b in token)

    ranks = {encoding.decode_single_token_bytes(i): i for i in range(tokenizer.EOT_ID)}
    vocab = {text(token): rank for token, rank in ranks.items()}
    vocab[_EOT] = tokenizer.EOT_ID
    merges = []
    for token, _ in sorted(ranks.items(), key=lambda item: item[1]):
        if len(token) > 1:
            left, right = _last_merge(ranks, token)
            merges.append(f"{text(left)} {text(right)}")
    return vocab, merges


def tokenizer_json() -> dict:
    vocab, merges = vocab_and_merges()
    byte_level = {"add_prefix_space": False, "trim_offsets": True, "use_regex": True}
    return {
        "version": "1.0",
        "truncation": None,
        "padding": None,
        "added_tokens": [_ADDED_TOKEN],
        "normalizer": None,
        "pre_tokenizer": {"type": "ByteLevel", **byte_level},
        "post_processor": {"type": "ByteLevel", **byte_level, "trim_offsets": False},
        "decoder": {"type": "ByteLevel", **byte_level},
        "model": {
            "type": "BPE",
            "dropout": None,
            "unk_token": None,
            "continuing_subword_prefix": "",
            "end_of_word_suffix": "",
            "fuse_unk": False,
            "byte_fallback": False,
            "ignore_merges": False,
            "vocab": vocab,
            "merges": merges,
        },
    }


def tokenizer_config(model_max_length: int) -> dict:
    """`tokenizer_config.json`. No clean-up of spaces on decoding: text round-trips as the server's."""
    return {
        "tokenizer_class": "GPT2Tokenizer",
        "add_bos_token": False,
        "add_prefix_space": False,
        "bos_token": _EOT,
        "eos_token": _EOT,
        "unk_token": _EOT,
        "clean_up_tokenization_spaces": False,
        "errors": "replace",
        "model_max_length": model_max_length,
        "added_tokens_decoder": {str(tokenizer.EOT_ID): {k: v for k, v in _ADDED_TOKEN.items() if k != "id"}},
    }


def build_files(model_max_length: int) -> dict[str, bytes]:
    """Every tokenizer file's bytes, built from the ranks (a fraction of a second, then cached)."""
    vocab, merges = vocab_and_merges()
    special = {"bos_token": _EOT, "eos_token": _EOT, "unk_token": _EOT}
    return {
        "vocab.json": _json_bytes(vocab, indent=None),
        "merges.txt": ("#version: 0.2\n" + "\n".join(merges) + "\n").encode(),
        "tokenizer.json": _json_bytes(tokenizer_json(), indent=None),
        "special_tokens_map.json": _json_bytes(special),
        CONFIG_FILE: _json_bytes(tokenizer_config(model_max_length)),
    }


def write_tokenizer_files(directory: str | Path, model_max_length: int) -> None:
    """Put the tokenizer files in a model directory (`model_max_length`: the model's n_positions)."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    for name, data in build_files(model_max_length).items():
        (directory / name).write_bytes(data)


def _json_bytes(data: dict, indent: int | None = 2) -> bytes:
    return (json.dumps(data, ensure_ascii=False, indent=indent) + "\n").encode()
