"""`wafer-gpt2 generate` end to end on a small checkpoint the test writes."""

from __future__ import annotations

import codecs
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from wafer_gpt2.cli.main import main
from wafer_gpt2.model import tokenizer
from wafer_gpt2.model.forward import KVCache, forward

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def small_checkpoint(small_params, tmp_path_factory) -> Path:
    from wafer_gpt2.model.hf_format import save_hf

    return save_hf(small_params, tmp_path_factory.mktemp("ckpt") / "small", dtype="float32")


def greedy_text(params, prompt: str, n: int) -> str:
    """The greedy continuation computed directly from the reference forward pass."""
    ids = tokenizer.encode(prompt)
    cache = KVCache(params.config)
    logits = forward(params, ids, cache, 0)[-1]
    out: list[int] = []
    for _ in range(n):
        token = int(np.argmax(logits))
        if token == tokenizer.EOT_ID:
            break
        out.append(token)
        logits = forward(params, [token], cache, len(ids) + len(out) - 1)[-1]
    # Only complete characters are printed: an unfinished one at the end is held back.
    return codecs.getincrementaldecoder("utf-8")("replace").decode(tokenizer.decode_bytes(out), final=False)


def generate(capsys, *argv: str) -> tuple[int, str, str]:
    code = main(["generate", *argv])
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def test_greedy_continuation_matches_the_reference(small_params, small_checkpoint, capsys):
    code, out, err = generate(
        capsys,
        "The wafer",
        "--weights",
        str(small_checkpoint),
        "--backend",
        "reference",
        "--greedy",
        "--max-new-tokens",
        "12",
    )
    assert code == 0, err
    assert out == greedy_text(small_params, "The wafer", 12) + "\n"
    assert len(out) > 1
    assert "tokens in" in err and "measured on backend reference" in err and "seed" not in err


def test_seeded_sampling_is_reproducible(small_checkpoint, capsys):
    argv = [
        "Once upon",
        "--weights",
        str(small_checkpoint),
        "--backend",
        "reference",
        "--max-new-tokens",
        "10",
    ]
    runs = [
        generate(capsys, *argv, "--seed", seed, "--top-k", "20", "--temperature", "0.9")
        for seed in ("7", "7", "8")
    ]
    assert all(code == 0 for code, _, _ in runs)
    assert runs[0][1] == runs[1][1]
    assert "seed 7" in runs[0][2]
    assert runs[0][1] != runs[2][1]


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        (["--greedy", "--temperature", "0.5"], "--greedy cannot be combined with --temperature"),
        (["--top-k", "1000"], "--top-k 1000 exceeds the 64 candidates"),
        (["--temperature", "0"], "--temperature must be between 0.0001 and 10000"),
        (["--top-p", "1.5"], "--top-p must be in (0, 1]"),
        (["--max-new-tokens", "0"], "--max-new-tokens must be at least 1"),
    ],
)
def test_bad_options_give_one_line(small_checkpoint, capsys, extra, message):
    code, out, err = generate(
        capsys, "hi", "--weights", str(small_checkpoint), "--backend", "reference", *extra
    )
    assert code == 2 and out == ""
    assert err.count("\n") == 1 and message in err


def test_bad_weights_and_long_prompts_give_one_line(small_checkpoint, tmp_path, capsys):
    code, _, err = generate(capsys, "hi", "--weights", str(tmp_path / "missing"), "--backend", "reference")
    assert code == 2 and err.count("\n") == 1 and "missing: no such file or directory" in err
    (tmp_path / "junk.bin").write_bytes(b"\x01\x02\x03\x04" * 300)
    code, _, err = generate(capsys, "hi", "--weights", str(tmp_path / "junk.bin"), "--backend", "reference")
    assert code == 2 and err.count("\n") == 1 and "bad magic" in err
    code, _, err = generate(
        capsys, "word " * 200, "--weights", str(small_checkpoint), "--backend", "reference"
    )
    assert code == 2 and "the prompt is 201 tokens; the model's context is 128" in err


def test_console_script_streams_in_a_real_process(small_params, small_checkpoint):
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    result = subprocess.run(
        [sys.executable, "-m", "wafer_gpt2.cli.main", "generate", "Hello", "--weights", str(small_checkpoint)]
        + ["--backend", "reference", "--greedy", "--max-new-tokens", "6"],
        capture_output=True,
        text=True,
        cwd=ROOT,
        env=env,
        timeout=120,
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout == greedy_text(small_params, "Hello", 6) + "\n"
