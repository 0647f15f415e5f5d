"""The SDK appliance protocol end to end on 127.0.0.1: the real `cerebras.sdk.client` against
`tools.appliance_server`, which executes on the embedded simulator.

Both sides run in .venv-appliance (`make appliance-venv`: Python 3.11, cerebras-sdk and
cerebras-appliance 2.10.0, numpy 1.25) with the repository on PYTHONPATH; this test drives them as
subprocesses and skips when that environment is missing. The client compiles a tiny GPT-2 through the
worker (SdkCompiler), uploads the artifact, creates and starts a runtime (SdkRuntime), round-trips
memcpy (blocking and non-blocking), runs the host program's steps and compares them with the
simulator run locally, and launches `clear_slot` on the wafer program. The client (cerebras-sdk
2.10.0, the 2.x line) is not of the kernels' SDK line (1.4): the backend accepts it only because the
loopback worker says it compiles no CSL, and refuses it towards any other worker or a cluster.
"""

from __future__ import annotations

import json
import os
import subprocess
import time
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
VENV_PYTHON = REPO / ".venv-appliance" / "bin" / "python"

pytestmark = pytest.mark.skipif(
    not VENV_PYTHON.exists(), reason="no .venv-appliance (build it with `make appliance-venv`)"
)


def appliance_env() -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": str(REPO), "OPENBLAS_NUM_THREADS": "1"}


@pytest.fixture(scope="module")
def worker(tmp_path_factory):
    """The loopback worker on a free port; stopped (by its own process) after the module."""
    root = tmp_path_factory.mktemp("worker")
    process = subprocess.Popen(
        [str(VENV_PYTHON), "-m", "tools.appliance_server", "--port", "0", "--root", str(root)],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=appliance_env(), cwd=REPO,
    )  # fmt: skip
    deadline = time.monotonic() + 60
    line = ""
    while time.monotonic() < deadline and not line.startswith("listening on"):
        line = process.stdout.readline()
        if not line and process.poll() is not None:
            pytest.fail(f"the worker exited with {process.returncode} before listening")
    if not line.startswith("listening on"):
        process.kill()
        pytest.fail("the worker did not start listening within 60 s")
    yield line.split("listening on", 1)[1].strip()
    process.terminate()
    try:
        process.wait(timeout=10)
    except subprocess.TimeoutExpired:
        process.kill()


def run_client(args: list[str], tmp_path: Path) -> subprocess.CompletedProcess:
    return subprocess.run([str(VENV_PYTHON), *args], capture_output=True, text=True, timeout=300,
                          env=appliance_env(), cwd=tmp_path)  # fmt: skip


def test_the_sdk_client_runs_the_host_flow_on_the_loopback_worker(worker, tmp_path):
    result = run_client(
        ["-m", "wafer_gpt2.backends.sdk_appliance", "check", "--address", worker, "--work", str(tmp_path)],
        tmp_path,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    report = json.loads(result.stdout.strip().splitlines()[-1])
    assert report["memcpy_round_trip"] and report["memcpy_nonblock_round_trip"]
    assert report["steps_match_local_simulator"], report
    assert [len(step) for step in report["top1"]] == [8, 2, 1]  # every item that asked for scores
    assert report["clear_slot_zeroed_slot_1"]
    assert any(
        p.name.endswith(".tar.gz") for p in (tmp_path / "artifact").iterdir()
    )  # SdkCompiler's artifact


CLIENT_ERRORS = r"""
import json, shutil, sys
from pathlib import Path
from wafer_gpt2.host.compile import prepare_sources
from wafer_gpt2.backends.sdk_appliance import appliance_compile
from wafer_gpt2.plan import build_plan
from wafer_gpt2.backends.sdk_appliance import ApplianceRuntime
from wafer_gpt2.model.config import GPT2Config

address, work = sys.argv[1], Path(sys.argv[2])
plan = build_plan(GPT2Config(n_layer=1, n_head=2, n_embd=16, vocab_size=50, n_positions=16, name="t"), slots=2, context=16, top_k=8)
job = prepare_sources(plan, work / "csl", simfabric=True)
out = {}
layout = job.src_dir / "layout.csl"
layout.write_text(layout.read_text().replace("@set_rectangle(", "@set_rectangle(1 + ", 1))
try:
    appliance_compile(job, work / "bad", grpc_address=address, simulator=True)
except Exception as exc:
    out["tampered_tables"] = str(exc)
prepare_sources(plan, work / "csl", simfabric=True)
artifact = appliance_compile(job, work / "good", grpc_address=address, simulator=True)
runtime = ApplianceRuntime(artifact, simulator=True, grpc_address=address)
runtime.load()
runtime.run()
try:
    runtime.get_id("no_such_symbol")
except Exception as exc:
    out["unknown_symbol"] = str(exc)
runtime.stop()
# A 2.10 client towards a cluster (no worker address) or a worker that is not the loopback one: the
# kernels' SDK line is not the client's, so the backend refuses before compiling.
try:
    appliance_compile(job, work / "cluster", simulator=True)
except Exception as exc:
    out["cluster"] = str(exc)
import grpc
from concurrent import futures
from wafer_gpt2.backends.sdk_appliance import check_sdk_line
other = grpc.server(futures.ThreadPoolExecutor(max_workers=1))
port = other.add_insecure_port("127.0.0.1:0")
other.start()
try:
    check_sdk_line({"grpc_address": f"127.0.0.1:{port}"})
except Exception as exc:
    out["other_worker"] = str(exc)
other.stop(None)
print(json.dumps(out))
"""


def test_worker_errors_reach_the_client_with_their_reason(worker, tmp_path):
    result = run_client(["-c", CLIENT_ERRORS, worker, str(tmp_path)], tmp_path)
    assert result.returncode == 0, result.stderr[-3000:]
    out = json.loads(result.stdout.strip().splitlines()[-1])
    # The client logs the compiler's output and raises a generic error, as it does with cslc's.
    assert "compile() failed" in out["tampered_tables"]
    assert "layout.csl is not what wafer_gpt2/codegen/ writes" in result.stderr
    assert "no symbol named 'no_such_symbol'" in out["unknown_symbol"]
    refusal = "written for the Cerebras SDK 1.4 line"
    assert refusal in out["cluster"] and "cerebras-sdk 2.10.0, of the 2.x line" in out["cluster"]
    assert refusal in out["other_worker"]


def test_the_loopback_worker_says_it_compiles_no_csl(worker):
    """The client accepts the loopback worker whatever its own SDK line: the worker compiles no CSL
    (it checks the upload and runs the plan on the simulator) and answers the identity call."""
    result = subprocess.run(
        [str(VENV_PYTHON), "-c", "import sys; from wafer_gpt2.backends.sdk_appliance import client_version, "
         "is_loopback_worker; print(client_version(), is_loopback_worker(sys.argv[1]))", worker],
        capture_output=True, text=True, timeout=120, env=appliance_env(), cwd=REPO,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.split() == ["2.10.0", "True"]
