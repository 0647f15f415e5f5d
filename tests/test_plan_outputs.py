"""What the `plan` and `cost` commands print and write: the text summary, the JSON, the PNG map."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from wafer_gpt2.cli.main import main
from wafer_gpt2.core import cost
from wafer_gpt2.model.config import GPT2Config
from wafer_gpt2.plan import build_plan
from wafer_gpt2.plan.drawing import draw_wafer_map

SMALL = GPT2Config(n_layer=2, n_head=4, n_embd=64, vocab_size=50257, n_positions=128, name="small")


def test_plan_command_writes_json_and_png(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    config_dir = tmp_path / "small"
    config_dir.mkdir()
    (config_dir / "config.json").write_text(json.dumps(SMALL.to_hf_dict()))
    out_json, out_png = tmp_path / "plan.json", tmp_path / "map.png"
    code = main(
        ["plan", "--model", str(config_dir), "--slots", "4", "--json", str(out_json), "--png", str(out_png)]
    )
    assert code == 0
    text = capsys.readouterr().out
    assert "modeled decode latency" in text and "us/token at 1.1 GHz" in text and "0.85 GHz" in text
    assert "imbalance max/mean" in text and "PEs used" in text

    data = json.loads(out_json.read_text())
    assert data["version"] == 1
    assert data["fabric"] == {"width": 757, "height": 996}
    summary = data["summary"]
    for key in ("pes_used", "sram_bytes_used", "max_pe_bytes", "colors_used", "replicas"):
        assert isinstance(summary[key], int) and summary[key] > 0
    modeled = summary["modeled"]
    for key in ("decode_latency_us", "tokens_per_s_single_stream", "tokens_per_s_total"):
        assert modeled[key] > 0
    assert "modeled" in modeled["note"]
    assert modeled["at_0_85_ghz"]["decode_latency_us"] > modeled["decode_latency_us"]
    region = data["regions"][0]
    for key in ("name", "kind", "layer", "x", "y", "w", "h", "max_pe_bytes"):
        assert key in region
    names = {r["name"] for r in data["regions"]}
    assert {"io.in", "io.out", "head", "ln_f", "L0.qkv", "L1.res_2"} <= names
    qkv = next(r for r in data["regions"] if r["name"] == "L0.qkv")
    assert qkv["tiling"]["type"] == "GemvTiling" and qkv["tiling"]["n_split"] == 3

    png = out_png.read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n" and len(png) > 20_000


def test_plan_command_reports_limits_in_one_line(capsys: pytest.CaptureFixture) -> None:
    assert main(["plan", "--model", "gpt2", "--slots", "200"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("wafer-gpt2 plan: error:") and "per-PE memory" in err and "Traceback" not in err
    assert main(["plan", "--model", "nope"]) == 2
    assert "unknown model 'nope'" in capsys.readouterr().err
    assert main(["plan", "--replicas", "x"]) == 2
    assert "--replicas must be" in capsys.readouterr().err


def test_cost_gemv_prints_the_total_last(capsys: pytest.CaptureFixture) -> None:
    assert main(["cost", "gemv", "--arch", "wse2", "--grid", "2x2", "--shape", "4x4", "--dtype", "fp16"]) == 0
    lines = capsys.readouterr().out.strip().splitlines()
    assert "modeled" in lines[0] and "chain reduction" in lines[0]
    assert all("(modeled)" in line for line in lines[1:-1])
    total = cost.standalone_gemv_cost("wse2", 2, 2, 4, 4, "fp16").cycles
    assert lines[-1].startswith(f"modeled total: {total} cycles")
    assert main(["cost", "gemv", "--grid", "16x", "--shape", "4x4"]) == 2
    assert "--grid must look like PxQ" in capsys.readouterr().err
    assert main(["cost", "gemv", "--grid", "8x8", "--shape", "4x4"]) == 2
    assert "more PEs than" in capsys.readouterr().err


def test_map_of_replicas(tmp_path: Path) -> None:
    plan = build_plan(SMALL, slots=2, objective="throughput", replicas=6)
    path = draw_wafer_map(plan, tmp_path / "replicas.png")
    assert path.read_bytes()[:4] == b"\x89PNG"
