"""More than one wafer: two real `wafer-gpt2 serve` processes behind HAProxy (Debian's), on loopback.

The balancer runs `deploy/haproxy/haproxy.cfg` itself, with only its DNS-discovered server line
replaced by the two servers' loopback addresses and its listener moved to a free port. What it
guarantees: the load is spread over both replicas; when one is killed (SIGKILL) mid-generation, every
request on it ends at once (a non-streaming one with the balancer's 502 JSON error, a stream cut
without its final event), none hangs, the streams on the other replica finish, and new requests keep
succeeding from the moment of the kill (a request that cannot connect is sent to the other replica).

Skipped, saying so, when no `haproxy` binary is installed (`make test` installs it when run as root).
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import pytest
from service_harness import free_port, run_concurrently, sse_events

from service.settings import FD_RESERVE

REPO = Path(__file__).resolve().parents[1]
HAPROXY_DIR = REPO / "deploy" / "haproxy"
HAPROXY = shutil.which("haproxy") or next(
    (path for path in ("/usr/sbin/haproxy", "/usr/local/sbin/haproxy") if os.access(path, os.X_OK)), None
)
NO_HAPROXY = "no haproxy binary (apt-get install haproxy; `make test` installs it when run as root)"
HANG_LIMIT_S = 30.0
LONG = 240  # tokens: the demo model's context is 256


def start_server(port: int) -> subprocess.Popen:
    command = [sys.executable, "-m", "service.cli", "serve", "--port", str(port), "--log-level", "warning"]
    command += ["--max-concurrent", "4", "--shutdown-timeout", "5"]
    env = {**os.environ, "PYTHONPATH": str(REPO), "OPENBLAS_NUM_THREADS": "1"}
    return subprocess.Popen(command, cwd=REPO, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)


def balancer_config(tmp_path: Path, listen: int, ports: list[int]) -> Path:
    """The shipped configuration, with loopback servers instead of DNS discovery."""
    text = (HAPROXY_DIR / "haproxy.cfg").read_text()
    servers = "\n".join(f"    server wafer{i + 1} 127.0.0.1:{port}" for i, port in enumerate(ports))
    text, found = re.subn(r"^\s*server-template .*$", servers, text, flags=re.M)
    assert found == 1
    text, found = re.subn(r"^\s*bind :8000$", f"    bind 127.0.0.1:{listen}", text, flags=re.M)
    assert found == 1
    shutil.copytree(HAPROXY_DIR / "errors", tmp_path / "errors")
    path = tmp_path / "haproxy.cfg"
    path.write_text(text)
    subprocess.run([HAPROXY, "-c", "-q", "-f", str(path)], check=True, timeout=30)
    return path


def served(port: int) -> float:
    text = httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=5).text
    found = re.search(r"^tgi_request_success (\S+)$", text, re.M)
    return float(found[1]) if found else 0.0


def running(port: int) -> float:
    text = httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=5).text
    found = re.search(r"^tgi_batch_current_size (\S+)$", text, re.M)
    return float(found[1]) if found else 0.0


def wait_healthy(url: str, process: subprocess.Popen | None = None, timeout: float = 90) -> None:
    deadline = time.monotonic() + timeout
    while True:
        if process is not None and process.poll() is not None:
            raise AssertionError(process.stderr.read().decode())
        try:
            if httpx.get(url + "/health", timeout=2).status_code == 200:
                return
        except httpx.TransportError:
            pass
        assert time.monotonic() < deadline, f"{url} never became healthy"
        time.sleep(0.1)


def long_stream(url: str) -> dict:
    body = {"prompt": "Two wafers", "max_tokens": LONG, "ignore_eos": True, "stream": True}
    events: list = []
    try:
        with httpx.Client(timeout=HANG_LIMIT_S) as client:
            with client.stream("POST", url + "/v1/completions", json=body) as response:
                for event in sse_events(response):
                    events.append(event)
        return {"status": response.status_code, "events": events, "error": None}
    except httpx.HTTPError as exc:
        return {"status": None, "events": events, "error": exc}


def long_request(url: str) -> httpx.Response | httpx.HTTPError:
    body = {"prompt": "Two wafers", "max_tokens": LONG, "ignore_eos": True}
    try:
        return httpx.post(url + "/v1/completions", json=body, timeout=HANG_LIMIT_S)
    except httpx.HTTPError as exc:
        return exc


@pytest.mark.slow  # among the slowest tests (make test-fast leaves it out)
@pytest.mark.skipif(HAPROXY is None, reason=NO_HAPROXY)
def test_two_replicas_behind_haproxy_survive_losing_one(tmp_path):
    ports = [free_port(), free_port()]
    servers = [start_server(port) for port in ports]
    balancer = None
    try:
        for port, process in zip(ports, servers, strict=True):
            wait_healthy(f"http://127.0.0.1:{port}", process)
        listen = free_port()
        config = balancer_config(tmp_path, listen, ports)
        balancer = subprocess.Popen(
            [HAPROXY, "-db", "-f", str(config)], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE
        )
        url = f"http://127.0.0.1:{listen}"
        wait_healthy(url, timeout=30)
        time.sleep(1.5)  # one round of health checks: both replicas up

        # The load is spread over both replicas.
        body = {"inputs": "Spread the load", "parameters": {"max_new_tokens": 8}}
        answers = run_concurrently([lambda: httpx.post(url + "/generate", json=body, timeout=60)] * 16)
        assert all(a.status_code == 200 for a in answers), [a.text for a in answers if a.status_code != 200]
        assert all(served(port) >= 2 for port in ports), [served(port) for port in ports]

        # Long requests on both, then one replica is killed mid-generation.
        results: list = []
        threads = [
            threading.Thread(target=lambda call=call: results.append(call(url)), daemon=True)
            for call in [long_stream] * 4 + [long_request] * 4
        ]
        for thread in threads:
            thread.start()
        deadline = time.monotonic() + 20
        while not all(running(port) > 0 for port in ports):
            assert time.monotonic() < deadline, "the long requests did not reach both replicas"
            time.sleep(0.02)
        servers[0].send_signal(signal.SIGKILL)
        killed_at = time.monotonic()
        servers[0].wait(10)  # gone: a request sent before this instant was on the killed replica

        # New requests keep succeeding from then on, before the health checks have noticed.
        after = [httpx.post(url + "/generate", json=body, timeout=60) for _ in range(10)]
        assert all(a.status_code == 200 for a in after), [a.text for a in after if a.status_code != 200]

        for thread in threads:
            thread.join(HANG_LIMIT_S)
            assert not thread.is_alive(), "a request hung after its replica was killed"
        ended_within = time.monotonic() - killed_at

        streams = [r for r in results if isinstance(r, dict)]
        plain = [r for r in results if not isinstance(r, dict)]
        cut = [s for s in streams if s["error"] is not None or s["events"][-1:] != ["[DONE]"]]
        complete = [s for s in streams if s not in cut]
        # A cut stream is a transport error (the connection closed mid-body), never a silent success.
        assert all(isinstance(s["error"], httpx.RemoteProtocolError) for s in cut), cut
        failed = [r for r in plain if not (isinstance(r, httpx.Response) and r.status_code == 200)]
        for response in failed:
            assert isinstance(response, httpx.Response) and response.status_code == 502, response
            assert response.json()["error_type"] == "unavailable" and "went away" in response.json()["error"]
        assert cut or failed, "nothing ran on the killed replica"
        assert complete or len(failed) < len(plain), "nothing ran on the surviving replica"
        assert len(cut) + len(failed) <= 4 + 1, (len(cut), len(failed))  # 4 slots on the killed one
        assert ended_within < HANG_LIMIT_S
    finally:
        if balancer is not None:
            balancer.terminate()
            balancer.wait(10)
        for process in servers:
            if process.poll() is None:
                process.terminate()
                process.wait(30)


# ----- the shipped deployment files (checked without Docker or a cluster) --------------------------


def yaml_documents(path: Path) -> list[dict]:
    import yaml

    return [doc for doc in yaml.safe_load_all(path.read_text()) if doc]


def test_kubernetes_manifests_probe_health_and_terminate_after_the_drain():
    from service.cli import build_parser

    deployment, headless = yaml_documents(REPO / "deploy" / "kubernetes" / "wafer-gpt2.yaml")
    assert deployment["kind"] == "Deployment" and headless["spec"]["clusterIP"] == "None"
    pod = deployment["spec"]["template"]["spec"]
    (container,) = pod["containers"]
    args = build_parser().parse_args(container["args"])
    assert args.command == "serve" and args.port == 8000 and args.host == "0.0.0.0"
    assert container["readinessProbe"]["httpGet"]["path"] == "/health"
    assert container["startupProbe"]["httpGet"]["path"] == "/health"
    assert container["livenessProbe"]["httpGet"]["path"] == "/metrics"  # 200 in every engine state
    assert any(env["name"] == "WAFER_GPT2_API_KEY" for env in container["env"])  # 0.0.0.0 needs it
    pre_stop = int(container["lifecycle"]["preStop"]["exec"]["command"][1])
    assert pod["terminationGracePeriodSeconds"] >= pre_stop + args.shutdown_timeout + 5

    balancer, service = yaml_documents(REPO / "deploy" / "kubernetes" / "balancer.yaml")
    env = {e["name"]: e["value"] for e in balancer["spec"]["template"]["spec"]["containers"][0]["env"]}
    assert env["WAFER_GPT2_SERVICE"] == headless["metadata"]["name"]
    assert service["spec"]["ports"][0]["port"] == 8000
    kustomization = yaml_documents(REPO / "deploy" / "kustomization.yaml")[0]
    for generator in kustomization["configMapGenerator"]:
        assert all((REPO / "deploy" / file).is_file() for file in generator["files"])


def test_compose_runs_replicas_behind_the_balancer():
    from service.cli import build_parser

    (compose,) = yaml_documents(REPO / "deploy" / "compose.yaml")
    server, balancer = compose["services"]["server"], compose["services"]["balancer"]
    args = build_parser().parse_args(server["command"])
    assert args.command == "serve" and args.port == 8000
    assert server["ulimits"]["nofile"]["soft"] >= args.max_connections + FD_RESERVE  # the cap is not lowered
    assert "ports" not in server and server["deploy"]["replicas"] == "${WAFER_GPT2_REPLICAS:-2}"
    assert server["environment"]["WAFER_GPT2_API_KEY"] == "${WAFER_GPT2_API_KEY:-}"
    assert balancer["environment"]["WAFER_GPT2_SERVICE"] == "server"
    assert balancer["ports"][0] == "${WAFER_GPT2_PUBLISH:-127.0.0.1}:8000:8000"
    assert balancer["depends_on"]["server"]["condition"] == "service_healthy"
    assert int(server["stop_grace_period"].rstrip("s")) > args.shutdown_timeout


@pytest.mark.skipif(HAPROXY is None, reason=NO_HAPROXY)
def test_the_shipped_haproxy_configuration_is_valid():
    env = {**os.environ, "WAFER_GPT2_SERVICE": "localhost", "WAFER_GPT2_MAX_REPLICAS": "4"}
    subprocess.run(
        [HAPROXY, "-c", "-q", "-f", str(HAPROXY_DIR / "haproxy.cfg")], check=True, env=env, timeout=30
    )
