"""The GPT-2 tokenizer files written into model directories: transformers and tokenizers load them
and tokenize exactly like the server (tiktoken over the vendored ranks)."""

from __future__ import annotations

import random

import pytest

from wafer_gpt2.model import hf_tokenizer, tokenizer
from wafer_gpt2.model.checkpoint import DEMO_MODEL_DIR
from wafer_gpt2.model.hf_format import save_hf

TEXTS = [
    "Hello world",
    "The wafer holds every layer.",
    "a<|endoftext|>b",
    "<|endoftext|>",
    "  leading spaces  and\n\nnewlines\t\ttabs   ",
    "émoji 🙂 中文 テスト ﷽",
    "don't I'll we've they'RE",
    "x" * 300,
    "The quick brown fox 12345 67.89!! ...",
    "<|endoftext|> not <|endoftext| or |endoftext|>",
]


def random_texts(count: int, seed: int = 0) -> list[str]:
    rng = random.Random(seed)
    alphabet = "abcXYZ 019 \n\t.,!?'’-éüß中文🙂" + "".join(chr(rng.randrange(32, 0x3000)) for _ in range(40))
    return ["".join(rng.choice(alphabet) for _ in range(rng.randrange(1, 60))) for _ in range(count)]


def test_the_demo_model_ships_the_files_the_builder_makes():
    for name, data in hf_tokenizer.build_files(model_max_length=256).items():
        assert (DEMO_MODEL_DIR / name).read_bytes() == data, name
    vocab, merges = hf_tokenizer.vocab_and_merges()
    assert len(vocab) == tokenizer.VOCAB_SIZE and len(merges) == 50_000  # as GPT-2's own files


@pytest.mark.parametrize("loader", ["transformers", "tokenizers"])
def test_hf_loaders_tokenize_like_the_server(loader):
    if loader == "transformers":
        from transformers import AutoTokenizer

        hf = AutoTokenizer.from_pretrained(DEMO_MODEL_DIR)
        assert hf.eos_token == "<|endoftext|>" and hf.eos_token_id == tokenizer.EOT_ID
        assert hf.model_max_length == 256

        def encode(text):
            return hf.encode(text)

        def decode(ids):
            return hf.decode(ids)
    else:
        from tokenizers import Tokenizer

        hf = Tokenizer.from_file(str(DEMO_MODEL_DIR / "tokenizer.json"))

        def encode(text):
            return hf.encode(text).ids

        def decode(ids):
            return hf.decode(ids, skip_special_tokens=False)

    for text in TEXTS + random_texts(200):
        ids = tokenizer.encode_prompt(text)
        assert encode(text) == ids, text
        assert decode(ids) == tokenizer.decode(ids), text


def test_save_hf_writes_the_tokenizer_for_gpt2_vocabularies(tmp_path, small_params):
    directory = save_hf(small_params, tmp_path / "model")
    for name in hf_tokenizer.TOKENIZER_FILES:
        assert (directory / name).is_file(), name
    config = (directory / "tokenizer_config.json").read_text()
    assert '"model_max_length": 128' in config
