"""A newcomer's first command, as the image builds it: the run dependencies alone, then one answer.

The test environment holds the test extras, which pull in packages the service imports without
declaring them (httptools came in that way once, and `make serve` crashed on a fresh clone while every
test passed). Here the files the service image copies (docker/Dockerfile's base stage) go into an empty
folder, `pip install .` puts them in a fresh virtual environment without extras, and the installed
`wafer-gpt2 serve` must answer `/generate` on loopback, started outside the repository so nothing of
the checkout can stand in for what the wheel lacks.
"""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys
import time
import venv
from pathlib import Path

import httpx
import pytest
from test_docker_files import DOCKER, REPO, stage

pytestmark = pytest.mark.slow


def image_sources() -> list[str]:
    """What the image's base stage copies from the repository, and checks that it installs no extra."""
    base = stage(DOCKER / "Dockerfile", "base")
    installs = [rest for word, rest in base if word == "RUN" and "pip install" in rest]
    assert installs, "docker/Dockerfile's base stage installs nothing with pip"
    assert all("pip install --no-cache-dir . " in f"{rest} " for rest in installs), installs
    sources: list[str] = []
    for word, rest in base:
        if word == "COPY" and not rest.startswith("--from"):
            sources += rest.split()[:-1]
    return sources


def tracked_copy(sources: list[str], dest: Path) -> None:
    """The tracked files under `sources`, as a fresh clone has them (no build output, no caches)."""
    listed = subprocess.run(
        ["git", "ls-files", "-z", "--", *sources], cwd=REPO, capture_output=True, check=True
    ).stdout.decode()
    files = [name for name in listed.split("\0") if name]
    assert files, f"git lists no files under {sources}"
    for name in files:
        target = dest / name
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(REPO / name, target)


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def installed_top_level(env_dir: Path) -> set[str]:
    """The top-level import names the project's wheel installed into `env_dir` (its RECORD)."""
    (record,) = env_dir.glob("lib/python*/site-packages/wafer_gpt2-*.dist-info/RECORD")
    names = {line.split(",")[0].split("/")[0] for line in record.read_text().splitlines() if line}
    return {name for name in names if not name.endswith(".dist-info") and name not in ("..", "__pycache__")}


def test_run_dependencies_alone_serve_a_generation(tmp_path):
    source, env_dir = tmp_path / "src", tmp_path / "venv"
    tracked_copy(image_sources(), source)
    # The test environment's pip installs into the fresh one (`--python`): no second pip to bootstrap,
    # and the current resolver, which `make` installs, instead of the one Python bundles.
    venv.create(env_dir, with_pip=False)
    python = env_dir / "bin" / "python"
    clean_env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    pip = [sys.executable, "-m", "pip", "--python", str(python)]
    install = subprocess.run(
        [*pip, "install", "-q", "--no-compile", "--disable-pip-version-check", "."],
        cwd=source,
        env=clean_env,
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert install.returncode == 0, install.stdout + install.stderr
    shutil.rmtree(source)  # only the installed wheel is left to serve from
    assert installed_top_level(env_dir) == {"wafer_gpt2", "csl_executor"}

    port = free_port()
    log = (tmp_path / "serve.log").open("w")
    server = subprocess.Popen(
        [str(env_dir / "bin" / "wafer-gpt2"), "serve", "--host", "127.0.0.1", "--port", str(port)],
        cwd=tmp_path,
        env=clean_env,
        stdout=log,
        stderr=subprocess.STDOUT,
    )
    try:
        url = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + 300
        with httpx.Client(base_url=url, timeout=30) as client:
            while True:
                assert server.poll() is None, (tmp_path / "serve.log").read_text()[-4000:]
                assert time.monotonic() < deadline, "the server was not ready within 300 s"
                try:
                    if client.get("/health").status_code == 200:
                        break
                except httpx.TransportError:
                    pass
                time.sleep(0.5)
            reply = client.post(
                "/generate", json={"inputs": "The meaning of life is", "parameters": {"max_new_tokens": 8}}
            )
        assert reply.status_code == 200, reply.text
        answer = reply.json()
        assert isinstance(answer["generated_text"], str) and answer["generated_text"]
    finally:
        server.terminate()
        try:
            server.wait(timeout=60)
        except subprocess.TimeoutExpired:
            server.kill()
        log.close()
