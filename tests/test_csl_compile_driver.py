"""The compile driver and `wafer-gpt2 compile --dry-run`: sources, plan tables and the cslc command."""

from __future__ import annotations

import json
import shlex

import pytest

from kernels.csl_syntax import check_file
from service.cli import main
from wafer.compile import CompileError, compile_program, prepare_sources
from wafer.plan import build_plan
from weights.config import GPT2Config

TINY = GPT2Config(n_layer=2, n_head=2, n_embd=16, vocab_size=100, n_positions=32, name="tiny")


@pytest.fixture(scope="module")
def tiny_plan():
    return build_plan(TINY, slots=2, context=32, top_k=8)


def test_prepare_sources_writes_kernels_tables_and_command(tmp_path, tiny_plan):
    job = prepare_sources(tiny_plan, tmp_path, simfabric=True)
    names = {p.name for p in job.src_dir.iterdir()}
    assert {
        "layout.csl",
        "gemv.csl",
        "attention.csl",
        "embed_head.csl",
        "reduce.csl",
        "plan_params.csl",
    } <= names
    assert check_file(job.src_dir / "plan_params.csl") == []
    argv = job.argv
    assert argv[:2] == ["cslc", str(job.src_dir / "layout.csl")]
    assert "--arch=wse2" in argv and "--memcpy" in argv and "--fabric-offsets=4,1" in argv
    w, h = job.params["kernel_w"], job.params["kernel_h"]
    assert f"--fabric-dims={w + 7},{h + 2}" in argv
    assert argv[-2:] == ["-o", str(job.bin_dir)]
    assert shlex.split(job.shell()) == argv
    params = dict(
        p.split(":") for p in next(a for a in argv if a.startswith("--params=")).split("=", 1)[1].split(",")
    )
    assert params == {"kernel_w": str(w), "kernel_h": str(h), "MEMCPYH2D_DATA_1_ID": "14",
                      "MEMCPYD2H_DATA_1_ID": "15", "use_fp16": "1"}  # fmt: skip
    assert json.loads((tmp_path / "compile.json").read_text())["argv"] == argv


def test_hardware_fabric_is_the_whole_wafer(tmp_path):
    plan = build_plan(TINY, slots=2, context=32, dtype="fp32")
    job = prepare_sources(plan, tmp_path, write=False)
    assert job.fabric_dims == (757, 996) and job.params["use_fp16"] == 0


def test_bad_options_name_the_problem(tmp_path, tiny_plan):
    with pytest.raises(ValueError, match="channels must be 1..16"):
        prepare_sources(tiny_plan, tmp_path, channels=0)


@pytest.mark.skipif(
    __import__("shutil").which("cslc") is not None, reason="cslc present: the SDK tests compile"
)
def test_without_cslc_the_error_says_what_to_do(tmp_path, tiny_plan):
    job = prepare_sources(tiny_plan, tmp_path, simfabric=True)
    assert compile_program(job, dry_run=True) is None
    with pytest.raises(CompileError, match="cslc is not on PATH"):
        compile_program(job)


def test_compile_command_dry_run_on_gpt2(tmp_path, capsys):
    """The real 124M plan: the command prints the full cslc line and writes the tables."""
    assert main(["compile", "--model", "gpt2", "--out", str(tmp_path), "--dry-run"]) == 0
    out, err = capsys.readouterr()
    argv = shlex.split(out.strip())
    assert argv[0] == "cslc" and "--arch=wse2" in argv and "--fabric-dims=757,996" in argv
    assert "dry run" in err
    tables = (tmp_path / "src" / "plan_params.csl").read_text()
    assert "const n_regions: u16 = 113;" in tables and "const rect_color = [" in tables
    assert check_file(tmp_path / "src" / "plan_params.csl") == []


def test_compile_command_dry_run_on_gpt2_wse3(tmp_path, capsys):
    """WSE-3: every reduction receives through one re-bound input queue, so the 124M plan fits."""
    assert main(["compile", "--model", "gpt2", "--arch", "wse3", "--out", str(tmp_path), "--dry-run"]) == 0
    out, err = capsys.readouterr()
    argv = shlex.split(out.strip())
    assert argv[0] == "cslc" and "--arch=wse3" in argv and "--fabric-dims=762,1172" in argv
    assert "dry run" in err
    tables = (tmp_path / "src" / "plan_params.csl").read_text()
    assert '"arch": "wse3"' in tables and check_file(tmp_path / "src" / "plan_params.csl") == []
    assert check_file(tmp_path / "src" / "reduce.csl") == []


@pytest.mark.parametrize("dtype", ["fp16", "fp32"])
def test_tiny_config_prepares_for_wse3(tmp_path, dtype):
    plan = build_plan(TINY, arch="wse3", slots=2, context=32, top_k=8, dtype=dtype)
    job = prepare_sources(plan, tmp_path, simfabric=True)
    assert "--arch=wse3" in job.argv and compile_program(job, dry_run=True) is None
    w, h = job.params["kernel_w"], job.params["kernel_h"]
    assert job.fabric_dims == (w + 7, h + 2) and (job.src_dir / "plan_params.csl").exists()


def test_wse3_compile_refuses_kernels_that_overrun_the_input_queues(tmp_path, tiny_plan, monkeypatch):
    """The driver runs the lint's queue check: a reduce.csl with a queue per receive is refused."""
    from kernels import csl_contract

    per_receive = csl_contract.source("reduce.csl").replace(
        "@get_input_queue(in_queue)", "@get_input_queue(in_queue + k)"
    )
    real = csl_contract.wse3_queue_problems
    monkeypatch.setattr(csl_contract, "wse3_queue_problems", lambda: real({"reduce.csl": per_receive}))
    plan = build_plan(TINY, arch="wse3", slots=2, context=32, top_k=8)
    with pytest.raises(CompileError, match="WSE-3's input queues"):
        prepare_sources(plan, tmp_path, write=False)


def test_sdk_backends_explain_a_missing_sdk():
    from wafer.sdk_appliance import ApplianceUnavailableError, import_client
    from wafer.sdk_container import SdkUnavailableError, import_sdk

    with pytest.raises(SdkUnavailableError, match="sdk-container needs the Cerebras SDK"):
        import_sdk()
    with pytest.raises(ApplianceUnavailableError, match="cerebras-sdk"):
        import_client()
