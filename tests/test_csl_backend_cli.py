"""`--backend csl` in generate, serve and bench: the generated CSL on the CSL executor behind the same
commands and the same HTTP service as the simulator.

A 512-token vocabulary keeps the executor quick; the prompt "The" encodes to id 464, inside it."""

from __future__ import annotations

import json

import pytest
from service_harness import backend_factory, reference_greedy, running_server

from tools.bench.bench_sim import main as bench_main
from wafer_gpt2.cli.main import main
from wafer_gpt2.model import tokenizer
from wafer_gpt2.model.config import GPT2Config
from wafer_gpt2.model.params import GPT2Params
from wafer_gpt2.settings import ServerSettings

CONFIG = GPT2Config(n_layer=2, n_head=2, n_embd=64, vocab_size=512, n_positions=64, name="tiny-csl")
PROMPT = "The"


@pytest.fixture(scope="module")
def params() -> GPT2Params:
    return GPT2Params.random(CONFIG, seed=9)


@pytest.fixture(autouse=True)
def build_in_tmp(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # --backend csl compiles into ./build/csl-executor


def test_generate_on_the_executor_equals_the_reference(params, write_checkpoint, capsys):
    weights = write_checkpoint(params)
    outputs = {}
    for backend in ("csl", "reference"):
        argv = ["generate", PROMPT, "--weights", str(weights), "--backend", backend, "--greedy",
                "--max-new-tokens", "4", "--dtype", "fp32"]  # fmt: skip
        assert main(argv) == 0
        captured = capsys.readouterr()
        outputs[backend] = captured.out
        assert f"measured on backend {backend}" in captured.err
    assert outputs["csl"] == outputs["reference"]


def test_serve_on_the_executor(params):
    assert tokenizer.encode(PROMPT) == [464]
    settings = ServerSettings(backend="csl", model_id="tiny-csl", dtype="fp32", max_concurrent_requests=2)
    factory = backend_factory("csl", params, slots=2, context=64, top_k=16)
    with running_server(settings, factory, wait_ready=False) as running:
        assert running.engine.wait_ready(120), running.engine.error
        with running.client(timeout=120) as client:
            body = {"inputs": PROMPT, "parameters": {"max_new_tokens": 3, "details": True}}
            details = client.post("/generate", json=body).json()["details"]
    expected, _, _ = reference_greedy(params, [464], 3)
    assert [t["id"] for t in details["tokens"]] == expected


def test_bench_on_the_executor(tmp_path, capsys):
    pytest.importorskip("transformers")
    config = tmp_path / "config.json"
    config.write_text(
        json.dumps({"n_layer": 1, "n_head": 2, "n_embd": 32, "vocab_size": 256, "n_positions": 16})
    )
    argv = ["sim", "--model", str(config), "--backend", "csl", "--batch", "2", "--new-tokens", "2",
            "--prompt-tokens", "3", "--reps", "1", "--dtype", "fp32"]  # fmt: skip
    assert bench_main(argv) == 0
    out = capsys.readouterr().out
    assert "CSL executor   batch  2" in out
    assert "greedy tokens of CSL executor and transformers: identical" in out
