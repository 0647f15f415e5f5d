"""Bad checkpoints at start-up: `wafer-gpt2 serve` refuses them before it ever listens.

What it guarantees: given a truncated checkpoint (safetensors, llm.c .bin), one with a
tensor of the wrong shape or with NaN values, a config that does not match the weights or is not valid, or a directory
without weights, the real `serve` process exits with status 2 and one error line that names the file
(and the tensor or field) at fault, and its port never accepts a connection: no server ever answers
with a half-loaded model. A good checkpoint, started the same way, does open the port (so the probe
that watches it is not blind).
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import numpy as np
import pytest
from safetensors.numpy import load_file, save_file
from service_harness import free_port

REPO = Path(__file__).resolve().parents[1]
EXIT_TIMEOUT_S = 60.0


def truncate(path: Path) -> None:
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])


def edit_config(directory: Path, **changes) -> None:
    config = json.loads((directory / "config.json").read_text())
    (directory / "config.json").write_text(json.dumps({**config, **changes}))


def bad_checkpoints(params, write_checkpoint) -> dict[str, tuple[Path, str]]:
    """name -> (checkpoint, what its error line must say)."""
    cases = {}

    directory = write_checkpoint(params, "safetensors")
    truncate(directory / "model.safetensors")
    cases["truncated safetensors"] = (directory, "model.safetensors: truncated")

    path = write_checkpoint(params, "llmc")
    truncate(path)
    cases["truncated llm.c .bin"] = (path, f"{path.name}: truncated")

    directory = write_checkpoint(params, "safetensors")
    tensors = load_file(directory / "model.safetensors")
    name = next(n for n in tensors if n.endswith("h.0.attn.c_attn.weight"))
    tensors[name] = np.ascontiguousarray(tensors[name].T)  # [out, in]: PyTorch Linear, not HF Conv1D
    save_file(tensors, directory / "model.safetensors")
    cases["a tensor of the wrong shape"] = (
        directory,
        "tensor 'h.0.attn.c_attn.weight' has shape (192, 64), expected (64, 192)",
    )

    directory = write_checkpoint(params, "safetensors")
    edit_config(directory, n_embd=96)
    cases["config: n_embd does not match"] = (
        directory,
        "tensor 'wte.weight' has shape (50257, 64), expected (50257, 96)",
    )

    directory = write_checkpoint(params, "safetensors")
    edit_config(directory, n_layer=3)
    cases["config: one layer too many"] = (directory, "missing tensors h.2.")

    directory = write_checkpoint(params, "safetensors")
    edit_config(directory, n_head=5)
    cases["config: n_head does not divide n_embd"] = (
        directory,
        "n_embd (64) must be divisible by n_head (5)",
    )

    directory = write_checkpoint(params, "safetensors")
    (directory / "config.json").write_text('{"n_layer": 2,')
    cases["config: not JSON"] = (directory, "config.json: not valid JSON")

    path = write_checkpoint(params, "llmc")
    header = np.fromfile(path, dtype="<i4", count=256)
    header[4] = 3  # L: one layer more than the file holds
    with open(path, "r+b") as f:
        f.write(header.tobytes())
    cases["llm.c header: one layer too many"] = (path, f"{path.name}: truncated")

    directory = write_checkpoint(params, "safetensors")
    tensors = load_file(directory / "model.safetensors")
    name = next(n for n in tensors if n.endswith("h.1.attn.c_proj.bias"))
    tensors[name][:2] = np.nan  # weights that load would make every step fail
    save_file(tensors, directory / "model.safetensors")
    cases["NaN weights"] = (directory, f"model.safetensors: tensor {name!r} holds 2 non-finite values")

    directory = write_checkpoint(params, "safetensors")
    (directory / "model.safetensors").unlink()
    cases["no weights"] = (directory, "no weights: expected model.safetensors")

    # Configs that used to load and then serve failures, or take minutes and gigabytes to refuse.
    for field, value, says in (
        (
            "layer_norm_epsilon",
            float("nan"),
            "config.json: 'layer_norm_epsilon' must be a positive finite number",
        ),
        ("layer_norm_epsilon", -1e-5, "config.json: 'layer_norm_epsilon' must be a positive finite number"),
        ("n_layer", 2.7, "config.json: field 'n_layer' must be an integer, got 2.7"),
        ("n_layer", 1_000_000, "config.json says n_layer=1000000, the weights hold 2 layers"),
        ("n_embd", True, "config.json: field 'n_embd' must be a number, got True"),
    ):
        directory = write_checkpoint(params, "safetensors")
        edit_config(directory, **{field: value})
        cases[f"config: {field} {value}"] = (directory, says)

    directory = write_checkpoint(params, "safetensors")
    (directory / "config.json").write_text(json.dumps([params.config.to_hf_dict()]))
    cases["config: a JSON list"] = (directory, "config.json: expected a JSON object, got a list")

    directory = write_checkpoint(params, "safetensors")
    rewrite_header(directory / "model.safetensors", lambda header: shift_offsets(header, -8))
    cases["safetensors: negative offsets"] = (directory, "data_offsets [-8, ")
    return cases


def rewrite_header(path: Path, change) -> None:
    """Rewrite a safetensors header in place (same length, padded with spaces)."""
    data = path.read_bytes()
    length = int.from_bytes(data[:8], "little")
    header = change(json.loads(data[8 : 8 + length]))
    encoded = json.dumps(header, separators=(",", ":")).encode()
    assert len(encoded) <= length
    path.write_bytes(data[:8] + encoded.ljust(length) + data[8 + length :])


def shift_offsets(header: dict, by: int) -> dict:
    """Move the first tensor's byte range by `by` (keeping its length, so only the sign gives it away)."""
    name = next(n for n in header if n != "__metadata__")
    begin, end = header[name]["data_offsets"]
    header[name]["data_offsets"] = [begin + by, end + by]
    return header


def start_serve(checkpoint: Path, port: int) -> subprocess.Popen:
    command = [sys.executable, "-m", "wafer_gpt2.cli.main", "serve", "--weights", str(checkpoint)]
    # The engine on a thread of the HTTP process (`serve`'s default runs it in a process of its own:
    # test_service_lifecycle).
    command += ["--port", str(port), "--log-level", "warning", "--no-engine-process"]
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    return subprocess.Popen(
        command, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )


def listening(port: int) -> bool:
    try:
        socket.create_connection(("127.0.0.1", port), timeout=0.2).close()
        return True
    except OSError:
        return False


@pytest.mark.slow  # among the slowest tests (make test-fast leaves it out)
def test_serve_refuses_bad_checkpoints_and_never_listens(small_params, write_checkpoint):
    cases = bad_checkpoints(small_params, write_checkpoint)
    running = {
        name: (start_serve(path, port), port)
        for name, (path, port) in ((name, (path, free_port())) for name, (path, _) in cases.items())
    }
    listened: set[str] = set()
    deadline = time.monotonic() + EXIT_TIMEOUT_S
    while any(process.poll() is None for process, _ in running.values()) and time.monotonic() < deadline:
        listened |= {
            name for name, (process, port) in running.items() if process.poll() is None and listening(port)
        }
        time.sleep(0.05)

    problems = []
    for name, (process, _) in running.items():
        if process.poll() is None:
            process.kill()
            problems.append(f"{name}: still running after {EXIT_TIMEOUT_S:.0f} s")
        _, stderr = process.communicate()
        lines = stderr.strip().splitlines()
        expected = cases[name][1]
        if process.returncode != 2:
            problems.append(f"{name}: exit status {process.returncode}, expected 2; stderr: {stderr[-300:]}")
        elif (
            len(lines) != 1
            or expected not in lines[0]
            or not lines[0].startswith("wafer-gpt2 serve: error: ")
        ):
            problems.append(f"{name}: expected one error line containing {expected!r}, got {lines}")
        if name in listened:
            problems.append(f"{name}: the port accepted a connection")
    assert not problems, "\n".join(problems)


def test_a_good_checkpoint_started_the_same_way_listens_and_serves(small_params, write_checkpoint):
    port = free_port()
    process = start_serve(write_checkpoint(small_params, "safetensors"), port)
    try:
        deadline = time.monotonic() + EXIT_TIMEOUT_S
        while not listening(port):
            assert process.poll() is None, process.communicate()[1]
            assert time.monotonic() < deadline, "the server never listened"
            time.sleep(0.05)
        url = f"http://127.0.0.1:{port}"
        while httpx.get(url + "/health", timeout=5).status_code != 200:
            assert time.monotonic() < deadline, "the server never became healthy"
            time.sleep(0.1)
        response = httpx.post(
            url + "/generate", json={"inputs": "Hello", "parameters": {"max_new_tokens": 2}}
        )
        assert response.status_code == 200
    finally:
        process.terminate()
        process.wait(timeout=30)
