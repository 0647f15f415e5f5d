"""The compile driver and `wafer-gpt2 compile`: the sources, the generated layout.csl, the cslc command,
and a compile on the project's CSL executor."""

from __future__ import annotations

import copy
import dataclasses
import json
import shlex

import pytest

from wafer_gpt2.cli.main import main
from wafer_gpt2.codegen import LAYOUT_HEADER, build_program
from wafer_gpt2.errors import ProgramError
from wafer_gpt2.host.compile import CompileError, compile_program, prepare_sources
from wafer_gpt2.model.config import GPT2Config
from wafer_gpt2.plan import build_plan
from wafer_gpt2.plan.structure import PlanError

TINY = GPT2Config(n_layer=2, n_head=2, n_embd=16, vocab_size=100, n_positions=32, name="tiny")


@pytest.fixture(scope="module")
def tiny_plan():
    return build_plan(TINY, slots=2, context=32, top_k=8)


def test_prepare_sources_writes_the_kernels_layout_and_command(tmp_path, tiny_plan):
    job = prepare_sources(tiny_plan, tmp_path, simfabric=True)
    names = {p.relative_to(job.src_dir).as_posix() for p in job.src_dir.rglob("*.csl")}
    assert {
        "layout.csl",
        "pe/gemv.csl",
        "pe/attention.csl",
        "pe/head.csl",
        "comm/chain.csl",
        "lib/topk.csl",
    } <= names
    layout = (job.src_dir / "layout.csl").read_text()
    request = json.loads(
        next(line for line in layout.splitlines() if line.startswith(LAYOUT_HEADER))[len(LAYOUT_HEADER) :]
    )
    assert request["arch"] == "wse2" and request["model"]["n_embd"] == 16
    argv = job.argv
    assert argv[:2] == ["cslc", str(job.src_dir / "layout.csl")]
    assert "--arch=wse2" in argv and "--memcpy" in argv and "--fabric-offsets=4,1" in argv
    w, h = job.fabric_dims
    assert (w - 7, h - 2) == (
        max(r.x + r.w for r in tiny_plan.regions),
        max(r.y + r.h for r in tiny_plan.regions),
    )
    assert argv[-2:] == ["-o", str(job.bin_dir)]
    assert shlex.split(job.shell()) == argv
    params = dict(
        p.split(":") for p in next(a for a in argv if a.startswith("--params=")).split("=", 1)[1].split(",")
    )
    assert params == {"MEMCPYH2D_DATA_1_ID": "14", "MEMCPYD2H_DATA_1_ID": "15"}
    assert json.loads((tmp_path / "compile.json").read_text())["argv"] == argv


def test_hardware_fabric_is_the_whole_wafer(tmp_path):
    plan = build_plan(TINY, slots=2, context=32, dtype="fp32")
    job = prepare_sources(plan, tmp_path, write=False)
    assert job.fabric_dims == (757, 996)


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


def test_compile_command_dry_run_prints_the_whole_wafer_command(tmp_path, capsys):
    """Without --simfabric the fabric is the whole wafer; the program itself is the plan's (the GPT-2
    124M program's scale is measured in tests/test_csl_defects.py)."""
    config = tmp_path / "config.json"
    config.write_text(
        json.dumps({"n_layer": 1, "n_head": 2, "n_embd": 16, "vocab_size": 60, "n_positions": 16})
    )
    args = ["compile", "--model", str(config), "--arch", "wse3", "--slots", "2", "--top-k", "4", "--out",
            str(tmp_path / "out"), "--dry-run"]  # fmt: skip
    assert main(args) == 0
    out, err = capsys.readouterr()
    argv = shlex.split(out.strip())
    assert argv[0] == "cslc" and "--arch=wse3" in argv and "--fabric-dims=762,1172" in argv
    assert "dry run" in err
    assert '"arch": "wse3"' in (tmp_path / "out" / "src" / "layout.csl").read_text()


@pytest.mark.parametrize("arch", ["wse2", "wse3"])
@pytest.mark.parametrize("dtype", ["fp16", "fp32"])
def test_tiny_config_compiles_on_the_executor(tmp_path, arch, dtype):
    plan = build_plan(TINY, arch=arch, slots=2, context=32, top_k=8, dtype=dtype)
    job = prepare_sources(plan, tmp_path, simfabric=True)
    assert f"--arch={arch}" in job.argv and compile_program(job, dry_run=True) is None
    compile_program(job, executor=True)
    out = json.loads((job.bin_dir / "out.json").read_text())
    assert out["params"] == {"MEMCPYH2D_DATA_1_ID": "14", "MEMCPYD2H_DATA_1_ID": "15"}


def test_compile_command_on_the_executor(tmp_path, capsys):
    config = tmp_path / "config.json"
    config.write_text(
        json.dumps({"n_layer": 1, "n_head": 2, "n_embd": 16, "vocab_size": 60, "n_positions": 16})
    )
    args = ["compile", "--model", str(config), "--slots", "2", "--top-k", "4", "--objective", "compact",
            "--simfabric", "--executor", "--out", str(tmp_path / "out")]  # fmt: skip
    assert main(args) == 0
    assert "compiled with the CSL executor (not cslc)" in capsys.readouterr().err
    assert (tmp_path / "out" / "bin" / "out.json").is_file()


def test_a_program_the_executor_refuses_is_a_compile_error(tmp_path, tiny_plan):
    job = prepare_sources(tiny_plan, tmp_path, simfabric=True)
    layout = job.src_dir / "layout.csl"
    layout.write_text(layout.read_text().replace("@set_rectangle(", "@set_rectangle(1 + ", 1))
    with pytest.raises(CompileError, match="the CSL executor refused the program: .*layout.csl:"):
        compile_program(job, executor=True)


def test_a_plan_whose_layers_normalise_in_their_strips_is_refused(tiny_plan):
    """The program folds every layer's LayerNorm into qkv and fc, as the simulator and the host do; a
    plan that normalises in a layer's strip is refused by name, not laid out half-supported."""
    plan = copy.deepcopy(tiny_plan)
    strip = plan.region("L1.ln_2")
    strip.tiling = dataclasses.replace(strip.tiling, normalise=True)
    with pytest.raises(
        PlanError, match=r"L1\.ln_2: a layer's LayerNorm is folded into L1\.fc .* this plan normalises"
    ):
        build_program(plan)
    build_program(tiny_plan)  # the plan as the planner made it lays out


def test_an_epilogue_shared_in_a_way_the_kernel_lacks_is_refused(tiny_plan):
    """pe/gemv.csl cuts unequal slices only for the multicast sharing (comm/spread.csl); relayed
    (comm/scatter.csl, comm/gather.csl) the slices are equal, so a count that does not divide the
    column's outputs is refused by name, as is one longer than the K-line."""
    plan = copy.deepcopy(tiny_plan)
    fc = plan.region("L1.fc")
    assert fc.tiling.tile_n == 4 and fc.tiling.rows == 8
    fc.tiling = dataclasses.replace(fc.tiling, epilogue_pes=3, epilogue_multicast=False)
    with pytest.raises(ProgramError, match=r"L1\.fc: 3 PEs cannot share its epilogue relayed"):
        build_program(plan)
    fc.tiling = dataclasses.replace(fc.tiling, epilogue_pes=5, epilogue_multicast=True)
    with pytest.raises(ProgramError, match=r"L1\.fc: 5 PEs cannot share its epilogue multicast"):
        build_program(plan)
    fc.tiling = dataclasses.replace(fc.tiling, epilogue_pes=3, epilogue_multicast=True)
    build_program(plan)  # unequal slices, multicast: laid out


def test_sdk_backends_explain_a_missing_sdk():
    from wafer_gpt2.backends.sdk_appliance import ApplianceUnavailableError, import_client
    from wafer_gpt2.backends.sdk_container import SdkUnavailableError, import_sdk

    with pytest.raises(SdkUnavailableError, match="sdk-container needs the Cerebras SDK"):
        import_sdk()
    with pytest.raises(ApplianceUnavailableError, match="cerebras-sdk"):
        import_client()


def test_the_appliance_backend_refuses_a_client_of_another_sdk_line():
    """The kernels are SDK 1.4 CSL (comptime_struct, @concat_structs); cerebras-sdk 2.10.0 (what its
    package reports) is a client of the 2.x line, whose compiler removed them. Without the loopback
    worker's word that it compiles nothing, the backend refuses before planning or compiling."""
    from wafer_gpt2.backends.sdk_appliance import SdkLineMismatchError, check_sdk_line
    from wafer_gpt2.host.compile import KERNELS_SDK

    assert KERNELS_SDK == "1.4"
    with pytest.raises(
        SdkLineMismatchError,
        match=r"written for the Cerebras SDK 1\.4 line .*comptime_struct.*@concat_structs.*"
        r"this client is cerebras-sdk 2\.10\.0, of the 2\.x line",
    ):
        check_sdk_line({"simulator": True}, version="2.10.0")
    check_sdk_line({}, version="1.4.0")  # kernels and client on one line
