"""The embedded default model (`wafer_gpt2/model/data/demo-gpt2`) and the script that trains it.

The shipped checkpoint is checked with the peer (Hugging Face `GPT2LMHeadModel`): it is a real GPT-2
directory within the size limit, it loads through the project's own loader, and it has learned
English (greedy text is English words; natural word order scores better than shuffled). The training
script is checked on a small synthetic fortune directory, so these tests need neither the Debian
`fortunes` packages nor minutes of CPU.
"""

from __future__ import annotations

import json
import random
import re
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors import safe_open

from tools import train_demo
from wafer_gpt2.model.checkpoint import DEMO_MODEL_DIR, load_checkpoint, resolve_weights
from wafer_gpt2.model.config import resolve_config
from wafer_gpt2.model.params import expected_shapes
from wafer_gpt2.model.tokenizer import EOT_ID, EOT_TEXT, VOCAB_SIZE, decode, encode

transformers = pytest.importorskip("transformers")

SIZE_LIMIT_BYTES = 16 * 2**20
COMMON_WORDS = {"the", "a", "to", "of", "and", "is", "you", "i", "in", "it", "that", "be", "not", "for"}


@pytest.fixture(scope="module")
def demo_model() -> transformers.GPT2LMHeadModel:
    return transformers.GPT2LMHeadModel.from_pretrained(DEMO_MODEL_DIR, dtype=torch.float32).eval()


def test_demo_config_is_a_gpt2_with_the_full_vocabulary() -> None:
    config = resolve_config(str(DEMO_MODEL_DIR))
    raw = json.loads((DEMO_MODEL_DIR / "config.json").read_text())
    assert raw["model_type"] == "gpt2"
    assert raw.get("tie_word_embeddings", True) is True
    assert config.vocab_size == VOCAB_SIZE
    assert config.n_positions >= 128
    assert config.n_embd % config.n_head == 0
    assert config.layer_norm_epsilon == 1e-5


def test_demo_checkpoint_is_fp16_within_the_size_limit_with_canonical_tensors() -> None:
    path = DEMO_MODEL_DIR / "model.safetensors"
    assert path.stat().st_size <= SIZE_LIMIT_BYTES, f"{path} is {path.stat().st_size} bytes"
    expected = expected_shapes(resolve_config(str(DEMO_MODEL_DIR)))
    with safe_open(path, framework="pt") as stored:
        names = list(stored.keys())
        shapes = {
            name.removeprefix("transformer."): tuple(stored.get_slice(name).get_shape()) for name in names
        }
        dtypes = {stored.get_slice(name).get_dtype() for name in names}
    assert shapes == expected  # tied LM head: no `lm_head.weight` stored
    assert dtypes == {"F16"}


def test_project_loader_reads_the_same_weights_as_transformers(demo_model) -> None:
    params = load_checkpoint(resolve_weights(None), progress=False)
    wte = demo_model.transformer.wte.weight.detach().numpy()
    assert params.wte.dtype == np.float32
    np.testing.assert_array_equal(params.wte, wte)


def test_greedy_text_is_english_words(demo_model) -> None:
    # Greedy decoding straight through `<|endoftext|>` (the model writes one short fortune after another).
    prompt = encode("The meaning of life is")
    ids = list(prompt)
    with torch.no_grad():
        for _ in range(24):
            ids.append(int(demo_model(torch.tensor([ids])).logits[0, -1].argmax()))
    text = decode(ids[len(prompt) :]).replace(EOT_TEXT, " ")
    assert text.isascii(), text
    words = re.findall(r"\S+", text)
    assert len(words) >= 10, text
    wordlike = [w for w in words if re.fullmatch(r"[\"'(]*[A-Za-z]+(?:'[a-z]+)?[.,;:!?\"')]*", w)]
    assert len(wordlike) >= 0.8 * len(words), text
    assert {w.strip(".,;:!?\"'()").lower() for w in words} & COMMON_WORDS, text


def test_natural_word_order_scores_better_than_shuffled(demo_model) -> None:
    sentence = encode(
        "If you want to be happy, do not tell the truth to your friends, and never work on a Monday."
    )
    shuffled = list(sentence)
    random.Random(0).shuffle(shuffled)

    def loss(ids: list[int]) -> float:
        batch = torch.tensor([[EOT_ID, *ids]])
        with torch.no_grad():
            return train_demo.next_token_loss(demo_model, batch).item()

    assert loss(sentence) < loss(shuffled) - 1.0


# ----------------------------------------------------------------------------------------------------
# The training script, on synthetic data


def write_fortune_dir(directory: Path) -> Path:
    subjects = ["A wise man", "The computer", "Your friend", "Every cat", "The moon"]
    verbs = ["never sleeps", "always knows", "will find", "cannot see", "likes"]
    objects = ["the truth.", "a good book.", "the answer.", "his own shadow.", "free lunch."]
    rng = random.Random(3)
    fortunes = [f"{rng.choice(subjects)} {rng.choice(verbs)} {rng.choice(objects)}" for _ in range(120)]
    directory.mkdir()
    (directory / "wisdom").write_text("\n%\n".join(fortunes[:60]) + "\n%\n")
    (directory / "more").write_text("%\n" + "\n%\n".join(fortunes[60:]) + "\n")
    (directory / "wisdom.dat").write_bytes(b"\x00\x00\x00\x02binary strfile index")
    (directory / "wisdom.u8").symlink_to("wisdom")
    return directory


def test_read_fortunes_splits_on_percent_lines_and_skips_indexes(tmp_path: Path) -> None:
    directory = tmp_path / "fortunes"
    directory.mkdir()
    (directory / "a").write_text("First line\n  second line\n%\n\n%\nSecond fortune, 100% sure.\n%\n")
    (directory / "a.dat").write_bytes(b"\xff\xfe index")
    (directory / "a.u8").symlink_to("a")
    assert train_demo.read_fortunes(directory) == ["First line\n  second line", "Second fortune, 100% sure."]


def test_clean_fortune_joins_lines_cuts_attribution_and_drops_pictures() -> None:
    fortune = "Never put off till tomorrow what you can\ndo -- the day after tomorrow.\n\t\t-- Mark Twain\n\tin a letter"
    assert (
        train_demo.clean_fortune(fortune)
        == "Never put off till tomorrow what you can do -- the day after tomorrow."
    )
    assert train_demo.clean_fortune("  /\\_/\\\n ( o.o )\n  > ^ <") is None
    assert train_demo.clean_fortune("\t\t-- Anonymous") is None


def test_missing_data_dir_tells_how_to_install_it(tmp_path: Path, capsys) -> None:
    assert train_demo.main(["--data-dir", str(tmp_path / "absent"), "--out", str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err
    assert str(tmp_path / "absent") in err and "apt-get install fortunes fortunes-min" in err
    assert not (tmp_path / "out").exists()


def test_split_holds_out_a_seeded_disjoint_fraction() -> None:
    fortunes = [f"fortune {i}" for i in range(200)]
    train, holdout = train_demo.split_fortunes(fortunes, 0.02, seed=5)
    assert len(holdout) == 4 and len(train) == 196
    assert sorted(train + holdout) == sorted(fortunes)
    assert train_demo.split_fortunes(fortunes, 0.02, seed=5) == (train, holdout)
    stream = train_demo.tokenize(holdout)
    assert (stream == EOT_ID).sum().item() == 4 and stream[-1].item() == EOT_ID


@pytest.mark.slow  # among the slowest tests (make test-fast leaves it out)
def test_training_run_writes_a_loadable_checkpoint_and_card(tmp_path: Path) -> None:
    data = write_fortune_dir(tmp_path / "fortunes")
    out = tmp_path / "model"
    argv = [
        "--data-dir",
        str(data),
        "--out",
        str(out),
        "--max-steps",
        "30",
        "--n-layer",
        "1",
        "--n-head",
        "2",
    ]
    argv += ["--n-embd", "16", "--n-positions", "32", "--block-size", "16", "--batch-size", "4"]
    argv += [
        "--warmup-steps",
        "5",
        "--log-interval",
        "10",
        "--eval-interval",
        "30",
        "--learning-rate",
        "1e-2",
    ]
    assert train_demo.main(argv) == 0
    model = transformers.GPT2LMHeadModel.from_pretrained(out)
    assert model.config.n_embd == 16 and model.config.vocab_size == VOCAB_SIZE
    assert next(model.parameters()).dtype == torch.float16
    card = (out / "README.md").read_text()
    assert "| steps | 30 (batch 4 x 16 tokens) |" in card
    losses = [float(x) for x in re.findall(r'"train_loss": ([0-9.]+)', card)]
    assert len(losses) == 3 and losses[-1] < losses[0]  # it learned something in 30 steps
    assert "greedy:" in card and "sampled" in card

    # Continue from that checkpoint on the files' raw layout: the shape comes from the checkpoint.
    again = tmp_path / "again"
    argv = ["--data-dir", str(data), "--out", str(again), "--init-from", str(out), "--keep-layout"]
    argv += ["--max-steps", "5", "--block-size", "16", "--batch-size", "4", "--log-interval", "5"]
    assert train_demo.main(argv) == 0
    continued = transformers.GPT2LMHeadModel.from_pretrained(again)
    assert continued.config.n_embd == 16 and continued.config.n_positions == 32
    assert not torch.equal(continued.transformer.h[0].mlp.c_fc.weight, model.transformer.h[0].mlp.c_fc.weight)


def test_init_from_a_directory_without_config_is_refused(tmp_path: Path, capsys) -> None:
    data = write_fortune_dir(tmp_path / "fortunes")
    argv = ["--data-dir", str(data), "--out", str(tmp_path / "out"), "--init-from", str(tmp_path)]
    assert train_demo.main(argv) == 2
    assert f"--init-from {tmp_path}: no config.json" in capsys.readouterr().err
