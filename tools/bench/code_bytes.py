"""Measure each PE program's code with the CSL executor's estimate, for the planner's table
(wafer_gpt2/core/code_bytes.py `CODE_BYTES`):

    python tools/bench/code_bytes.py            # print the table
    python tools/bench/code_bytes.py --write    # rewrite it in wafer_gpt2/core/code_bytes.py

Every PE program is compiled on the executor in a few reference plans that together give it every
role the generator gives (both dtypes; chains and two-level reductions, a shared epilogue relayed or multicast,
the head's workers, its tree in two levels and its rounds apart: the configurations of
tests/test_csl_program.py), and the table keeps, per program,
the largest `csl_executor.codesize.program_code_bytes` over its param sets. A few minutes on 2 cores.
"""

from __future__ import annotations

import argparse
import hashlib
import re
import sys
import tempfile
from dataclasses import replace
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
TABLE = ROOT / "wafer_gpt2" / "core" / "code_bytes.py"


def reference_plans(arch: str) -> list[Any]:
    """Plans whose PE programs together take every role the generator gives."""
    from wafer_gpt2.model.config import GPT2Config
    from wafer_gpt2.plan import build_plan

    plans = []
    for dtype in ("fp32", "fp16"):
        # the compact plans of the executor's tests
        compact = GPT2Config(n_layer=1, n_head=2, n_embd=64, vocab_size=512, n_positions=64, name="compact")
        plans.append(
            build_plan(compact, arch=arch, dtype=dtype, slots=2, context=64, top_k=16, objective="compact")
        )
        wider = GPT2Config(n_layer=1, n_head=4, n_embd=128, vocab_size=2048, n_positions=128, name="wider")
        plans.append(
            build_plan(wider, arch=arch, dtype=dtype, slots=2, context=128, top_k=16, objective="compact")
        )
        # two-level reductions everywhere, attention's merge rounds included
        levels = GPT2Config(n_layer=2, n_head=2, n_embd=16, vocab_size=200, n_positions=32, name="levels")
        plans.append(build_plan(levels, arch=arch, dtype=dtype, slots=2, context=32, top_k=8))
        # fc's GELU shared by the last PEs of its K-lines; the head's logits held by workers before
        # each root
        small = GPT2Config(n_layer=1, n_head=2, n_embd=16, vocab_size=100, n_positions=32, name="small")
        shared = build_plan(small, arch=arch, dtype=dtype, slots=1, context=32, top_k=8)
        fc, head = shared.region("L0.fc"), shared.region("head")
        fc_tiling: Any = fc.tiling
        fc.tiling = replace(fc_tiling, epilogue_pes=4 if fc_tiling.tile_n % 4 == 0 else 2)
        head_tiling: Any = head.tiling
        shared.head = head.tiling = replace(head_tiling, workers=5)
        plans.append(shared)
        # the same GELU shared by a multicast and a chain sum (comm/spread.csl)
        spread = build_plan(small, arch=arch, dtype=dtype, slots=1, context=32, top_k=8)
        fc = spread.region("L0.fc")
        fc_tiling = fc.tiling
        fc.tiling = replace(
            fc_tiling, epilogue_pes=4 if fc_tiling.tile_n % 4 == 0 else 2, epilogue_multicast=True
        )
        plans.append(spread)
        # the head's tree over its roots in two levels
        tree = GPT2Config(n_layer=1, n_head=2, n_embd=16, vocab_size=600, n_positions=32, name="tree")
        two = build_plan(tree, arch=arch, dtype=dtype, slots=1, context=32, top_k=8)
        head = two.region("head")
        head_tiling = head.tiling
        two.head = head.tiling = replace(head_tiling, tree="two_level", tree_group=3)
        plans.append(two)
        # the head's workers and root apart, after its K-lines' weighted PEs, in two sets taking the
        # items in turn (a throughput plan's)
        apart = build_plan(
            compact, arch=arch, dtype=dtype, slots=4, context=64, top_k=16, objective="throughput", replicas=1
        )
        if not (apart.head.apart and apart.head.sets == 2):
            raise SystemExit(
                "the reference throughput plan no longer runs the head's rounds apart in two sets"
            )
        plans.append(apart)
    return plans


def measure(arch: str) -> dict[str, int]:
    """The executor's code estimate of every PE program, the largest over the reference plans."""
    from csl_executor.codesize import program_code_bytes
    from csl_executor.layout import Options, compile_layout
    from wafer_gpt2.codegen.build import PE_FILES
    from wafer_gpt2.host.compile import FABRIC_OFFSETS, prepare_sources

    programs = {file: program for program, file in PE_FILES.items()}
    found: dict[str, int] = {}
    with tempfile.TemporaryDirectory(prefix="wafer-code-bytes-") as tmp:
        for n, plan in enumerate(reference_plans(arch)):
            job = prepare_sources(plan, Path(tmp) / str(n), simfabric=True)
            options = Options(arch=job.arch, fabric_dims=job.fabric_dims, fabric_offsets=FABRIC_OFFSETS,
                              params=dict(job.params), memcpy=True, channels=job.channels)  # fmt: skip
            for compiled in compile_layout(str(job.src_dir / "layout.csl"), options).programs:
                program = programs[Path(compiled.path).relative_to(job.src_dir).as_posix()]
                found[program] = max(found.get(program, 0), program_code_bytes(compiled))
    return dict(sorted(found.items()))


def sources_digest() -> str:
    """A digest of what the measurement reads besides the planner: the kernels, the generator and the
    modules it reads (those a compile is keyed by) and the executor's code estimate. The table records
    the digest it was measured on, so a change to any of them without a new measurement fails a fast
    test."""
    from wafer_gpt2.backends.csl import program_sources

    digest = hashlib.sha256()
    for path in [*program_sources(), ROOT / "csl_executor" / "codesize.py"]:
        digest.update(path.resolve().relative_to(ROOT).as_posix().encode() + b"\0" + path.read_bytes())
    return digest.hexdigest()[:16]


def table_text(tables: dict[str, dict[str, int]]) -> str:
    lines = [f'CODE_SOURCES = "{sources_digest()}"  # tools/bench/code_bytes.py sources_digest()']
    lines.append("CODE_BYTES: dict[str, dict[str, int]] = {")
    for arch, table in tables.items():
        lines.append(f'    "{arch}": {{')
        lines += [f'        "{program}": {size},' for program, size in table.items()]
        lines.append("    },")
    return "\n".join([*lines, "}"])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python tools/bench/code_bytes.py", description=__doc__.split("\n\n")[0]
    )
    parser.add_argument(
        "--write", action="store_true", help="rewrite the table in wafer_gpt2/core/code_bytes.py"
    )
    args = parser.parse_args(argv)
    table = table_text({arch: measure(arch) for arch in ("wse2", "wse3")})
    if not args.write:
        print(table)
        return 0
    pattern = re.compile(r"(# BEGIN GENERATED[^\n]*\n).*?(\n# END GENERATED)", re.S)
    TABLE.write_text(pattern.sub(lambda m: m[1] + table + m[2], TABLE.read_text(), count=1))
    return 0


if __name__ == "__main__":
    sys.path.insert(0, str(ROOT))
    sys.exit(main())
