"""The SDK's two commands on the executor: `cslc` (compile a layout, write an output folder) and
`cs_python SCRIPT` (run a host script with the SDK's module names importable from `shim/`).

`csl_executor.cli` puts them on the `csl-executor` command line; `csl_executor.calibrate` runs them on
WaferLLM's programs.
"""

from __future__ import annotations

import argparse
import runpy
import sys
from pathlib import Path

from csl_executor.errors import CslError
from csl_executor.layout import Options, compile_layout
from csl_executor.sdk import write_output

SHIM_DIR = Path(__file__).parent / "shim"


def _pairs(values: list[str], what: str, as_int: bool = True) -> dict[str, int]:
    out: dict[str, int] = {}
    for value in values:
        for item in value.split(","):
            item = item.strip()
            if not item:
                continue
            if ":" not in item:
                raise SystemExit(f"cslc: {what} {item!r}: expected NAME:VALUE")
            name, v = item.split(":", 1)
            try:
                out[name.strip()] = int(v, 0)
            except ValueError:
                raise SystemExit(f"cslc: {what} {item!r}: the value must be an integer") from None
    return out


def _dims(v: str, what: str) -> tuple[int, int]:
    try:
        a, b = v.split(",")
        return int(a), int(b)
    except ValueError:
        raise SystemExit(f"cslc: {what}={v!r}: expected W,H") from None


def cslc_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="cslc",
        description="Compile a CSL layout with the project's executor (not Cerebras cslc): checks the "
        "program like a compiler would and writes an output folder for cs_python / SdkRuntime.",
    )
    p.add_argument("layout", help="the layout file (layout.csl)")
    p.add_argument("--arch", default="wse2", choices=["wse2", "wse3"])
    p.add_argument("--fabric-dims", required=True, help="W,H of the (simulated) fabric")
    p.add_argument("--fabric-offsets", default="4,1", help="X,Y of the kernel's north-west PE")
    p.add_argument("--params", action="append", default=[], help="NAME:VALUE[,NAME:VALUE...] (repeatable)")
    p.add_argument("--colors", action="append", default=[], help="NAME:COLOR[,...] (repeatable)")
    p.add_argument("--memcpy", action="store_true", help="link the memcpy infrastructure")
    p.add_argument("--channels", type=int, default=1, help="memcpy I/O channels (1-16)")
    p.add_argument("--width-west-buf", type=int, default=0)
    p.add_argument("--width-east-buf", type=int, default=0)
    p.add_argument("-o", "--output", default="out", help="output folder")
    p.add_argument("--verbose", action="store_true", help="accepted for compatibility; no effect")
    return p


def cslc_main(argv: list[str] | None = None) -> int:
    args = cslc_parser().parse_args(argv)
    args.output = args.output[1:] if args.output.startswith("=") else args.output  # `-o=out`
    if not 1 <= args.channels <= 16:
        print(f"cslc: --channels={args.channels}: expected 1-16", file=sys.stderr)
        return 2
    options = Options(
        arch=args.arch,
        fabric_dims=_dims(args.fabric_dims, "--fabric-dims"),
        fabric_offsets=_dims(args.fabric_offsets, "--fabric-offsets"),
        params=_pairs(args.params, "--params"),
        colors=_pairs(args.colors, "--colors"),
        memcpy=args.memcpy,
        channels=args.channels,
        width_west_buf=args.width_west_buf,
        width_east_buf=args.width_east_buf,
    )
    try:
        compiled = compile_layout(args.layout, options)
    except CslError as exc:
        print(f"cslc: error: {exc}", file=sys.stderr)
        return 1
    for warning in compiled.warnings:
        print(f"cslc: warning: {warning}", file=sys.stderr)
    write_output(compiled, args.output)
    return 0


def cs_python_main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help"):
        print("usage: cs_python SCRIPT [ARGS...]: run a host script with the SDK's modules on the executor")
        return 0 if argv else 2
    script = Path(argv[0])
    if not script.is_file():
        print(f"cs_python: no script {script}", file=sys.stderr)
        return 2
    sys.path[:0] = [str(SHIM_DIR), str(script.resolve().parent)]
    sys.argv = [str(script)] + argv[1:]
    try:
        runpy.run_path(str(script), run_name="__main__")
    except SystemExit as exc:
        return int(exc.code or 0) if not isinstance(exc.code, str) else 1
    except CslError as exc:
        print(f"cs_python: error: {exc}", file=sys.stderr)
        return 1
    return 0
