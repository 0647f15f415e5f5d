"""More than one wafer: two real `wafer-gpt2 serve` processes behind HAProxy (Debian's), on loopback.

The balancer runs `deploy/haproxy/haproxy.cfg` itself, with only its DNS-discovered server line
replaced by the two servers' loopback addresses and its listeners moved to free loopback ports. What it
guarantees:

- a request whose body never comes stays at the balancer: no replica's connection is held for it;
- a client whose connection to the balancer has carried a request before gets the balancer's 502 JSON
  error (with `x-should-retry: false`) when its replica dies mid-generation, not a bare close, and the
  openai client does not run the generation again behind its caller's back;
- the load is spread over both replicas; when one is killed (SIGKILL) mid-generation, every request on
  it ends at once (a non-streaming one with the 502, a stream cut without its final event), none hangs,
  the streams on the other replica finish, and new requests keep succeeding from the moment of the kill
  (a request that cannot connect is sent to the other replica);
- a rolling restart under load (each replica in turn gets SIGTERM, drains, exits and starts again)
  loses no request: a replica that shuts down closes its port first, so what would have reached it is
  retried on the other one.

Skipped, saying so, when no `haproxy` binary is installed (`make test` installs it when run as root).
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from service_harness import free_port, run_concurrently, sse_events

from wafer_gpt2.settings import FD_RESERVE

REPO = Path(__file__).resolve().parents[1]
HAPROXY_DIR = REPO / "deploy" / "haproxy"
HAPROXY = shutil.which("haproxy") or next(
    (path for path in ("/usr/sbin/haproxy", "/usr/local/sbin/haproxy") if os.access(path, os.X_OK)), None
)
NO_HAPROXY = "no haproxy binary (apt-get install haproxy; `make test` installs it when run as root)"
HANG_LIMIT_S = 30.0
LONG = 240  # tokens: the demo model's context is 256
SHORT = {"inputs": "Spread the load", "parameters": {"max_new_tokens": 8}}


def start_server(port: int) -> subprocess.Popen:
    command = [
        sys.executable,
        "-m",
        "wafer_gpt2.cli.main",
        "serve",
        "--port",
        str(port),
        "--backend",
        "reference",
    ]
    command += ["--log-level", "warning"]
    command += ["--max-concurrent", "4", "--shutdown-timeout", "5"]
    env = {**os.environ, "PYTHONPATH": str(REPO), "OPENBLAS_NUM_THREADS": "1"}
    return subprocess.Popen(command, cwd=REPO, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)


def balancer_config(tmp_path: Path, listen: int, stats: int, ports: list[int]) -> Path:
    """The shipped configuration, with loopback servers instead of DNS discovery."""
    text = (HAPROXY_DIR / "haproxy.cfg").read_text()
    servers = "\n".join(f"    server wafer{i + 1} 127.0.0.1:{port}" for i, port in enumerate(ports))
    for pattern, replacement in (
        (r"^\s*server-template .*$", servers),
        (r"^\s*bind :8000$", f"    bind 127.0.0.1:{listen}"),
        (r"^\s*bind :8404$", f"    bind 127.0.0.1:{stats}"),
    ):
        text, found = re.subn(pattern, replacement, text, flags=re.M)
        assert found == 1, pattern
    shutil.copytree(HAPROXY_DIR / "errors", tmp_path / "errors")
    path = tmp_path / "haproxy.cfg"
    path.write_text(text)
    subprocess.run([HAPROXY, "-c", "-q", "-f", str(path)], check=True, timeout=30)
    return path


def metric(port: int, name: str) -> float:
    text = httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=5).text
    found = re.search(rf"^{name} (\S+)$", text, re.M)
    return float(found[1]) if found else 0.0


def served(port: int) -> float:
    return metric(port, "tgi_request_success")


def running(port: int) -> float:
    return metric(port, "tgi_batch_current_size")


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


class Cluster:
    """Two replicas behind the balancer."""

    def __init__(self, tmp_path: Path):
        self.ports = [free_port(), free_port()]
        self.servers = [start_server(port) for port in self.ports]
        self.balancer: subprocess.Popen | None = None
        for port, process in zip(self.ports, self.servers, strict=True):
            wait_healthy(f"http://127.0.0.1:{port}", process)
        listen, self.stats = free_port(), free_port()
        config = balancer_config(tmp_path, listen, self.stats, self.ports)
        self.balancer = subprocess.Popen(
            [HAPROXY, "-db", "-f", str(config)], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
        )
        self.url = f"http://127.0.0.1:{listen}"
        wait_healthy(self.url, timeout=30)
        for i in range(len(self.ports)):
            self.wait_in_rotation(i)

    def balancer_metrics(self) -> str:
        return httpx.get(f"http://127.0.0.1:{self.stats}/metrics", timeout=5).text

    def in_rotation(self, i: int) -> bool:
        """The balancer's health checks have found replica `i` up."""
        pattern = rf'^haproxy_server_status\{{proxy="replicas",server="wafer{i + 1}",state="UP"\}} 1$'
        return re.search(pattern, self.balancer_metrics(), re.M) is not None

    def wait_in_rotation(self, i: int, timeout: float = 30) -> None:
        deadline = time.monotonic() + timeout
        while not self.in_rotation(i):
            assert time.monotonic() < deadline, f"the balancer never took replica {i} in"
            time.sleep(0.1)

    def restart(self, i: int) -> None:
        """Start replica `i` again (after it exited) and wait until the balancer sends it requests."""
        assert self.servers[i].poll() is not None
        self.servers[i] = start_server(self.ports[i])
        wait_healthy(f"http://127.0.0.1:{self.ports[i]}", self.servers[i])
        self.wait_in_rotation(i)

    def restore(self) -> None:
        """Restart whichever replica a test stopped."""
        for i, process in enumerate(self.servers):
            if process.poll() is not None:
                self.restart(i)

    def close(self) -> None:
        if self.balancer is not None:
            self.balancer.terminate()
            self.balancer.wait(10)
        for process in self.servers:
            if process.poll() is None:
                process.terminate()
                process.wait(30)


@pytest.fixture(scope="module")
def started_cluster(tmp_path_factory) -> Iterator[Cluster]:
    if HAPROXY is None:
        pytest.skip(NO_HAPROXY)
    cluster = None
    try:
        cluster = Cluster(tmp_path_factory.mktemp("haproxy"))
        yield cluster
    finally:
        if cluster is not None:
            cluster.close()


@pytest.fixture
def cluster(started_cluster: Cluster) -> Iterator[Cluster]:
    """The two replicas behind the balancer, both running again after the test."""
    yield started_cluster
    started_cluster.restore()


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


def long_request(url: str, client: httpx.Client | None = None) -> httpx.Response | httpx.HTTPError:
    body = {"prompt": "Two wafers", "max_tokens": LONG, "ignore_eos": True}
    try:
        if client is not None:
            return client.post(url + "/v1/completions", json=body, timeout=HANG_LIMIT_S)
        return httpx.post(url + "/v1/completions", json=body, timeout=HANG_LIMIT_S)
    except httpx.HTTPError as exc:
        return exc


def assert_balancer_502(response) -> None:
    """`response` (httpx's, or the openai client's own) is the balancer's 502."""
    assert getattr(response, "status_code", None) == 502, response
    assert response.json()["error_type"] == "unavailable" and "went away" in response.json()["error"]
    assert response.headers["x-should-retry"] == "false"  # SDKs that retry 5xx on their own do not


def kill_the_busy_replica(cluster: Cluster) -> None:
    """SIGKILL the first replica that runs a request, and wait until it is gone."""
    deadline = time.monotonic() + 20
    while True:
        busy = [i for i, port in enumerate(cluster.ports) if running(port) > 0]
        if busy:
            break
        assert time.monotonic() < deadline, "no request reached a replica"
        time.sleep(0.02)
    cluster.servers[busy[0]].send_signal(signal.SIGKILL)
    cluster.servers[busy[0]].wait(10)


@pytest.mark.slow  # starts two replicas and the balancer (make test-fast leaves it out)
def test_a_request_whose_body_never_comes_holds_no_replica(cluster):
    """Twenty requests whose headers came and whose body never does: the balancer holds them itself
    (until `timeout http-request`); without `option http-buffer-request` each held a replica's
    connection, and the replicas' caps fell to a few hundred of them."""
    head = (
        b"POST /generate HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: 100\r\n\r\n"
    )
    listen = int(cluster.url.rsplit(":", 1)[1])
    held = []
    try:
        for _ in range(20):
            sock = socket.create_connection(("127.0.0.1", listen), timeout=5)
            sock.sendall(head)
            held.append(sock)
        time.sleep(0.5)
        text = cluster.balancer_metrics()
        assert re.search(r'^haproxy_frontend_current_sessions\{proxy="wafer_gpt2"\} (2[0-9])$', text, re.M), (
            text
        )
        assert re.search(r'^haproxy_backend_current_sessions\{proxy="replicas"\} 0$', text, re.M), text
        assert httpx.post(cluster.url + "/generate", json=SHORT, timeout=60).status_code == 200
    finally:
        for sock in held:
            sock.close()


@pytest.mark.slow
def test_a_kept_alive_client_gets_the_502_when_its_replica_dies(cluster):
    """The openai client (which retries connection errors and 5xx on its own, twice by default), its
    connection to the balancer kept alive from an earlier request, when the replica running its next
    one is killed: it gets the balancer's 502 JSON error and does not run the generation again on the
    other replica (HAProxy 2.6.12 closed such a connection without an answer, and the client retried)."""
    import openai

    with openai.OpenAI(base_url=cluster.url + "/v1", api_key="none", max_retries=2, timeout=60) as client:
        assert client.completions.create(model="demo-gpt2", prompt="Kept alive", max_tokens=2).choices
        result: list = []

        def long_completion() -> None:
            try:
                result.append(
                    client.completions.create(
                        model="demo-gpt2",
                        prompt="Two wafers",
                        max_tokens=LONG,
                        extra_body={"ignore_eos": True},
                    )
                )
            except openai.APIError as exc:
                result.append(exc)

        thread = threading.Thread(target=long_completion, daemon=True)
        thread.start()
        kill_the_busy_replica(cluster)
        thread.join(HANG_LIMIT_S)
        assert not thread.is_alive(), "the request hung after its replica was killed"
    (error,) = result
    assert isinstance(error, openai.InternalServerError), error  # not retried into a success elsewhere
    assert_balancer_502(error.response)


@pytest.mark.slow
def test_two_replicas_behind_haproxy_survive_losing_one(cluster):
    url = cluster.url
    before = [served(port) for port in cluster.ports]
    # The load is spread over both replicas.
    answers = run_concurrently([lambda: httpx.post(url + "/generate", json=SHORT, timeout=60)] * 16)
    assert all(a.status_code == 200 for a in answers), [a.text for a in answers if a.status_code != 200]
    spread = [served(port) - b for port, b in zip(cluster.ports, before, strict=True)]
    assert all(n >= 2 for n in spread), spread

    # Long requests on both, then one replica is killed mid-generation.
    results: list = []
    threads = [
        threading.Thread(target=lambda call=call: results.append(call(url)), daemon=True)
        for call in [long_stream] * 4 + [long_request] * 4
    ]
    for thread in threads:
        thread.start()
    deadline = time.monotonic() + 20
    while not all(running(port) > 0 for port in cluster.ports):
        assert time.monotonic() < deadline, "the long requests did not reach both replicas"
        time.sleep(0.02)
    cluster.servers[0].send_signal(signal.SIGKILL)
    killed_at = time.monotonic()
    cluster.servers[0].wait(10)  # gone: a request sent before this instant was on the killed replica

    # New requests keep succeeding from then on, before the health checks have noticed.
    after = [httpx.post(url + "/generate", json=SHORT, timeout=60) for _ in range(10)]
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
        assert_balancer_502(response)
    assert cut or failed, "nothing ran on the killed replica"
    assert complete or len(failed) < len(plain), "nothing ran on the surviving replica"
    assert len(cut) + len(failed) <= 4 + 1, (len(cut), len(failed))  # 4 slots on the killed one
    assert ended_within < HANG_LIMIT_S


@pytest.mark.slow
def test_a_rolling_restart_under_load_loses_nothing(cluster):
    """Clients on kept-alive connections send short requests (some streamed) without pause while each
    replica in turn gets SIGTERM, drains, exits and is started again: every request succeeds (before,
    those the draining replica received until the health checks took it out got 503, not retried)."""
    stop = threading.Event()
    outcomes: list = []
    deadline = time.monotonic() + 180  # the load stops by itself whatever happens to the test

    def plain() -> None:
        with httpx.Client(timeout=60) as client:
            for _ in range(150):
                if stop.is_set() or time.monotonic() > deadline:
                    return
                try:
                    response = client.post(cluster.url + "/generate", json=SHORT)
                    ok = response.status_code == 200 and "generated_text" in response.json()
                    outcomes.append("ok" if ok else (response.status_code, response.text))
                except httpx.HTTPError as exc:
                    outcomes.append(exc)
                time.sleep(0.02)

    def streamed() -> None:
        with httpx.Client(timeout=60) as client:
            for _ in range(150):
                if stop.is_set() or time.monotonic() > deadline:
                    return
                try:
                    with client.stream("POST", cluster.url + "/generate_stream", json=SHORT) as response:
                        events = list(sse_events(response))
                    ok = (
                        response.status_code == 200
                        and events
                        and events[-1].get("generated_text") is not None
                    )
                    outcomes.append("ok" if ok else (response.status_code, events[-1:]))
                except httpx.HTTPError as exc:
                    outcomes.append(exc)
                time.sleep(0.02)

    clients = [threading.Thread(target=plain, daemon=True) for _ in range(3)]
    clients.append(threading.Thread(target=streamed, daemon=True))
    for thread in clients:
        thread.start()
    try:
        for i in range(len(cluster.ports)):
            time.sleep(1.0)  # the load reaches both replicas
            before = len(outcomes)
            cluster.servers[i].send_signal(signal.SIGTERM)
            assert cluster.servers[i].wait(30) == 0
            # As a replica that comes back later than the checks take to see it go (a new pod, or the
            # model's upload): one back sooner at the same address would be sent requests while it loads.
            while cluster.in_rotation(i):
                time.sleep(0.1)
            cluster.restart(i)
            assert len(outcomes) > before, "no request was served during the restart"
        time.sleep(1.0)
    finally:
        stop.set()
        for thread in clients:
            thread.join(90)
    failures = [o for o in outcomes if o != "ok"]
    assert not failures, (len(failures), len(outcomes), failures[:5])
    assert len(outcomes) >= 100, len(outcomes)


# ----- the shipped deployment files (checked without Docker or a cluster) --------------------------


def yaml_documents(path: Path) -> list[dict]:
    import yaml

    return [doc for doc in yaml.safe_load_all(path.read_text()) if doc]


def test_kubernetes_manifests_probe_health_and_terminate_after_the_drain():
    from wafer_gpt2.cli.main import build_parser

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
    # A draining server's port is closed: liveness must not fail before the drain ends.
    liveness = container["livenessProbe"]
    assert liveness["periodSeconds"] * liveness["failureThreshold"] > args.shutdown_timeout

    balancer, service = yaml_documents(REPO / "deploy" / "kubernetes" / "balancer.yaml")
    env = {e["name"]: e["value"] for e in balancer["spec"]["template"]["spec"]["containers"][0]["env"]}
    assert env["WAFER_GPT2_SERVICE"] == headless["metadata"]["name"]
    assert service["spec"]["ports"][0]["port"] == 8000
    kustomization = yaml_documents(REPO / "deploy" / "kustomization.yaml")[0]
    for generator in kustomization["configMapGenerator"]:
        assert all((REPO / "deploy" / file).is_file() for file in generator["files"])


def test_compose_runs_replicas_behind_the_balancer():
    from wafer_gpt2.cli.main import build_parser

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
