"""Benchmark and evaluation clients, unmodified, against a real server on loopback: lm-eval's
`local-completions` on a local task (scoring and generation), and a short guidellm run (its default
mode: streaming chat completions) that tokenizes with the files in a model directory the project wrote.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from service_harness import backend_factory, running_server

from wafer_gpt2.model import tokenizer
from wafer_gpt2.settings import ServerSettings

pytestmark = pytest.mark.slow

DOCS = [
    {"question": "The wafer holds every", "choices": [" layer", " banana", " cloud"], "answer": 0},
    {"question": "Once upon a", "choices": [" time", " wafer"], "answer": 0},
    {"question": "Hello", "choices": [" world", " there", "!"], "answer": 1},
]
TASK = """
task: wafer_tiny_choice
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
output_type: multiple_choice
doc_to_text: "{{{{question}}}}"
doc_to_choice: "{{{{choices}}}}"
doc_to_target: answer
metric_list:
  - metric: acc
---
task: wafer_tiny_generate
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
output_type: generate_until
doc_to_text: "{{{{question}}}}"
doc_to_target: "{{{{choices[answer]}}}}"
generation_kwargs:
  until: ["\\n"]
  max_gen_toks: 6
metric_list:
  - metric: exact_match
"""


@pytest.fixture(scope="module")
def server(small_params):
    settings = ServerSettings(backend="reference", model_id="tiny-gpt2", max_concurrent_requests=4)
    with running_server(settings, backend_factory("reference", small_params, slots=4)) as running:
        yield running


@pytest.fixture
def model_dir(small_params, write_checkpoint) -> Path:
    """A model directory as the project writes one (save_hf): weights, config and tokenizer files."""
    return write_checkpoint(small_params)


def write_tasks(directory: Path) -> None:
    data = directory / "docs.jsonl"
    data.write_text("".join(json.dumps(doc) + "\n" for doc in DOCS))
    for i, text in enumerate(TASK.split("---")):
        (directory / f"task{i}.yaml").write_text(text.format(data=data))


@pytest.mark.parametrize("backend", ["huggingface", "remote"])
def test_lm_eval_local_completions(server, model_dir, tmp_path, monkeypatch, backend):
    import lm_eval
    from lm_eval.tasks import TaskManager

    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    write_tasks(tmp_path)
    model_args = {
        "model": "tiny-gpt2",
        "base_url": server.url + "/v1/completions",
        "tokenizer_backend": backend,
    }
    if backend == "huggingface":
        model_args["tokenizer"] = str(model_dir)  # the tokenizer files save_hf wrote
    results = lm_eval.simple_evaluate(
        model="local-completions",
        model_args=model_args,
        tasks=["wafer_tiny_choice", "wafer_tiny_generate"],
        task_manager=TaskManager(include_path=str(tmp_path)),
        log_samples=True,
    )
    samples = results["samples"]["wafer_tiny_choice"]
    assert len(samples) == len(DOCS)
    # lm-eval's loglikelihood of each choice is the server's own score of its tokens.
    with server.client() as client:
        for sample in samples:
            doc = sample["doc"]
            for (context, continuation), response in zip(
                [a for a in sample["arguments"]], sample["resps"], strict=True
            ):
                ids = tokenizer.encode_prompt(context + continuation)
                n = len(tokenizer.encode_prompt(continuation))
                body = {"prompt": ids, "max_tokens": 0, "echo": True, "logprobs": 1}
                scored = client.post("/v1/completions", json=body).json()["choices"][0]["logprobs"]
                np.testing.assert_allclose(response[0][0], sum(scored["token_logprobs"][-n:]), rtol=1e-4)
            assert doc in DOCS
    generated = results["samples"]["wafer_tiny_generate"]
    assert len(generated) == len(DOCS) and all(isinstance(s["resps"][0][0], str) for s in generated)
    server.wait_idle()


def test_guidellm_short_run(server, model_dir, tmp_path):
    out = tmp_path / "guidellm.json"
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1"}
    command = [
        Path(sys.executable).parent / "guidellm",
        "run",
        f"--backend=kind=openai_http,target={server.url}",
        "--profile=kind=concurrent,streams=2",
        "--constraint=kind=max_requests,count=6",
        "--data=kind=synthetic_text,prompt_tokens=16,output_tokens=8",
        f"--tokenizer=kind=huggingface_auto,model={model_dir}",
        f"--output=kind=json,path={out}",
        "--disable-console-interactive",
    ]
    done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=240)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    (benchmark,) = json.loads(out.read_text())["benchmarks"]
    totals = benchmark["metrics"]["request_totals"]
    # guidellm's own max_requests constraint counted 5 of 6 once on a loaded CI run (none errored or
    # incomplete): its count is guidellm's; that every request it sent succeeded is the server's.
    assert totals["errored"] == totals["incomplete"] == 0, totals
    assert totals["successful"] == totals["total"] >= 5, totals
    for request in benchmark["requests"]["successful"]:
        assert request["output_metrics"]["text_tokens"] == 8
    server.wait_idle()
