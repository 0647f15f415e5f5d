"""`cslc` without the SDK: evaluate a layout file, compile every tile code, check the whole program.

`compile_layout` is the executor's compiler driver. It evaluates `layout.csl` with the command-line
params, compiles one `Program` per distinct (file, params) that `@set_tile_code` names, and checks what
only the whole layout shows: the fabric is large enough for the kernel and memcpy's columns, routes
connect, exported names agree across PEs, WSE-2 task IDs do not collide with the colors that reach a
PE, and each input queue serves one color. Every error names `file:line` and the rule.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from csl_executor import arch as archs
from csl_executor import ast
from csl_executor.codesize import breakdown as codesize_breakdown
from csl_executor.codesize import program_code_bytes
from csl_executor.compiler import Compiler, freeze
from csl_executor.errors import CslCompileError
from csl_executor.parse import parse_file
from csl_executor.program import PE_MEMORY_WORDS, ColorConfig, ModuleInstance, Program
from csl_executor.types import COLOR, COMPTIME_INT, Color, CslType, PointerType, Struct

DIR_DELTA = {"NORTH": (0, -1), "SOUTH": (0, 1), "EAST": (1, 0), "WEST": (-1, 0)}
OPPOSITE = {"NORTH": "SOUTH", "SOUTH": "NORTH", "EAST": "WEST", "WEST": "EAST"}


@dataclass
class Options:
    """`cslc`'s command line, as far as the executor uses it."""

    arch: str = "wse2"
    fabric_dims: tuple[int, int] | None = None
    fabric_offsets: tuple[int, int] = (4, 1)
    params: dict[str, int] = field(default_factory=dict)
    colors: dict[str, int] = field(default_factory=dict)
    memcpy: bool = False
    channels: int = 1
    width_west_buf: int = 0
    width_east_buf: int = 0
    # The SDK line whose language rules apply: "1.4" (the public examples' line), or e.g. "2.10",
    # which adds the *T -> *[1]T coercion. From WAFER_CSL_SDK when not given.
    sdk: str = field(default_factory=lambda: os.environ.get("WAFER_CSL_SDK", "1.4"))


@dataclass
class LayoutProgram:
    """What a layout file builds: the rectangle, tile codes, routes and host-visible names."""

    arch: str
    path: str
    rectangle: tuple[int, int] | None = None
    tiles: dict[tuple[int, int], tuple[str, Struct, str]] = field(default_factory=dict)
    routes: dict[tuple[int, int, int], ColorConfig] = field(default_factory=dict)
    export_names: dict[str, tuple[CslType, bool, str]] = field(default_factory=dict)
    memcpy_colors: dict[str, int] = field(default_factory=dict)
    memcpy_size: tuple[int, int] | None = None
    modules: dict[Any, ModuleInstance] = field(default_factory=dict)
    native_state: dict[str, Any] = field(default_factory=dict)

    def set_rectangle(self, w: int, h: int, where: str) -> None:
        if self.rectangle is not None:
            raise CslCompileError(f"{where}: @set_rectangle is called twice")
        if w <= 0 or h <= 0:
            raise CslCompileError(f"{where}: @set_rectangle({w}, {h}): the kernel needs at least one PE")
        self.rectangle = (w, h)

    def _inside(self, x: int, y: int, where: str, what: str) -> None:
        if self.rectangle is None:
            raise CslCompileError(f"{where}: {what} before @set_rectangle")
        w, h = self.rectangle
        if not (0 <= x < w and 0 <= y < h):
            raise CslCompileError(f"{where}: {what} at ({x}, {y}) lies outside the {w} x {h} rectangle")

    def set_tile_code(self, x: int, y: int, path: str, params: Struct, where: str) -> None:
        self._inside(x, y, where, "@set_tile_code")
        if (x, y) in self.tiles:
            raise CslCompileError(
                f"{where}: PE ({x}, {y}) is given a tile code twice (first at {self.tiles[(x, y)][2]})"
            )
        if not Path(path).is_file():
            raise CslCompileError(f"{where}: @set_tile_code: no file {path}")
        self.tiles[(x, y)] = (path, params, where)

    def set_color_config(self, x: int, y: int, color: Color, config: ColorConfig, where: str) -> None:
        self._inside(x, y, where, "@set_color_config")
        key = (x, y, color.id)
        if key in self.routes:
            raise CslCompileError(
                f"{where}: color {color.id} at PE ({x}, {y}) is configured twice (first at {self.routes[key].where})"
            )
        self.routes[key] = config

    def export_name(self, name: str, t: CslType, mutable: bool, where: str) -> None:
        if name in self.export_names:
            raise CslCompileError(f"{where}: @export_name({name!r}) is given twice")
        self.export_names[name] = (t, bool(mutable), where)

    def set_memcpy(self, width: int, height: int, colors: dict[str, int], where: str) -> None:
        self.memcpy_size = (width, height)
        self.memcpy_colors = dict(colors)


@dataclass
class CompiledLayout:
    """Everything the runtime needs: what `cslc` leaves in its output folder, in memory."""

    options: Options
    layout: LayoutProgram
    programs: list[Program]
    pe_program: dict[tuple[int, int], Program]
    routes: dict[tuple[int, int, int], ColorConfig]
    params: dict[str, int]
    warnings: list[str] = field(default_factory=list)  # what cslc prints without failing

    @property
    def rectangle(self) -> tuple[int, int]:
        """The kernel's size (compile_layout rejects a layout that never calls @set_rectangle)."""
        if self.layout.rectangle is None:
            raise RuntimeError("internal: a compiled layout without a rectangle")
        return self.layout.rectangle

    @property
    def width(self) -> int:
        return self.rectangle[0]

    @property
    def height(self) -> int:
        return self.rectangle[1]


def compile_layout(layout_path: str | Path, options: Options) -> CompiledLayout:
    layout_path = str(Path(layout_path).resolve())
    comp = Compiler(options.arch, {"memcpy": options.memcpy, "sdk": options.sdk})
    lp = LayoutProgram(options.arch, layout_path)
    file = parse_file(layout_path)
    declared = {d.name for d in file.decls if isinstance(d, ast.VarDecl) and d.kind == "param"}
    given: dict[str, Any] = dict(options.params)
    types: dict[str, CslType] = {k: COMPTIME_INT for k in given}
    for name, cid in options.colors.items():  # --colors gives a layout's `param name: color`
        archs.check_color_id(options.arch, cid, f"{layout_path}:1: --colors {name}")
        given[name], types[name] = Color(cid), COLOR
    for name in given:
        if name not in declared:
            raise CslCompileError(
                f"{layout_path}:1: --params/--colors name {name!r}, which the layout does not declare"
            )
    params = Struct(tuple(given.items()), tuple(types.items()))
    mod = ModuleInstance(lp, layout_path, file, params)
    comp.evaluate_module(mod, layout=True)
    if lp.rectangle is None:
        raise CslCompileError(f"{layout_path}:1: the layout never calls @set_rectangle")
    if lp.memcpy_size is not None and lp.memcpy_size != lp.rectangle:
        raise CslCompileError(
            f"{layout_path}:1: <memcpy/get_params> was given {lp.memcpy_size[0]} x {lp.memcpy_size[1]}, "
            f"but the rectangle is {lp.rectangle[0]} x {lp.rectangle[1]}"
        )
    if options.memcpy and lp.memcpy_size is None:
        raise CslCompileError(
            f"{layout_path}:1: --memcpy is given but the layout never imports <memcpy/get_params>"
        )
    check_fabric(options, lp.rectangle, layout_path)
    comp.layout_info["rectangle"] = lp.rectangle
    comp.layout_info["memcpy_colors"] = set(lp.memcpy_colors.values())
    programs: dict[Any, Program] = {}
    pe_program: dict[tuple[int, int], Program] = {}
    for (x, y), (path, tparams, _where) in sorted(lp.tiles.items(), key=lambda kv: (kv[0][1], kv[0][0])):
        key = (path, freeze(tparams))
        prog = programs.get(key)
        if prog is None:
            prog = Program(options.arch, path, tparams)
            pmod = comp.new_module(prog, path, tparams)
            prog.modules[(path, key[1])] = pmod
            comp.evaluate_module(pmod)
            finish_program(comp, prog)
            programs[key] = prog
        pe_program[(x, y)] = prog
    compiled = CompiledLayout(options, lp, list(programs.values()), pe_program, {}, dict(options.params))
    compiled.warnings = comp.warnings
    compiled.routes = merge_routes(compiled)
    check_layout(compiled)
    return compiled


def check_fabric(options: Options, rect: tuple[int, int], where: str) -> None:
    """The fabric must hold the kernel at its offsets plus memcpy's columns (SDK "Tensor streaming")."""
    if options.fabric_dims is None:
        raise CslCompileError("cslc: --fabric-dims=W,H is required")
    dim_x, dim_y = options.fabric_dims
    off_x, off_y = options.fabric_offsets
    w, h = rect
    if options.memcpy:
        min_x = 4 + options.width_west_buf
        if off_x < min_x or off_y < 1:
            raise CslCompileError(
                f"{where}: --fabric-offsets={off_x},{off_y}: with memcpy the kernel starts at x >= {min_x} "
                f"(3 memcpy columns, a halo and {options.width_west_buf} west buffer columns) and y >= 1"
            )
        need_x = off_x + w + 3 + options.width_east_buf
        need_y = off_y + h + 1
    else:
        need_x, need_y = off_x + w, off_y + h
    if dim_x < need_x or dim_y < need_y:
        raise CslCompileError(
            f"{where}: --fabric-dims={dim_x},{dim_y} is too small: a {w} x {h} kernel at offsets "
            f"{off_x},{off_y} needs at least {need_x},{need_y}"
            + (" (memcpy takes 2 columns and a halo east of the kernel)" if options.memcpy else "")
        )


def finish_program(comp: Compiler, prog: Program) -> None:
    """Compile every task and exported function, and resolve task references made by function."""
    from csl_executor.compiler import Ctx
    from csl_executor.pe import wavelet_decoder

    for _tid, binding in sorted(prog.tasks.items()):
        comp.ensure_compiled(binding.fn)
        ctx = Ctx(comp, binding.fn.module, "comptime")
        types = [ctx.ctype(p.type) for p in binding.fn.decl.params]
        if binding.kind == "local" and types:
            raise CslCompileError(f"{binding.where}: a local task takes no arguments")
        binding.fn.py.decode = wavelet_decoder(types)
    for exp in prog.exports.values():
        if exp.kind == "fn":
            assert exp.fn is not None  # a "fn" export always carries its FnSym
            decl = exp.fn.decl
            if decl.is_task:
                raise CslCompileError(f"{exp.where}: a task cannot be exported; export a fn")
            if len(decl.params) > 15:
                raise CslCompileError(f"{exp.where}: an exported function takes at most 15 parameters")
            comp.ensure_compiled(exp.fn)
    resolved: list[tuple[str, Any, str]] = []
    for op, tid, where in prog.startup:
        if op == "set_task_priority":  # ((task ID, level)): a task named by function is resolved
            ref, high = tid
            if isinstance(ref, tuple):
                bound = prog.task_fn(ref[1])
                if bound is None:
                    raise CslCompileError(
                        f"{where}: task_priority({ref[1].name}): the task is never bound to an ID"
                    )
                ref = bound
            resolved.append((op, (ref, high), where))
            continue
        if op == "load_dsr":  # (dsr, dsd, options): resolve the tasks its options name by function
            dsr, dsd, opts = tid
            opts = dict(opts)
            for key in ("activate", "unblock"):
                ref = opts.get(key)
                if isinstance(ref, tuple):
                    bound = prog.task_fn(ref[1])
                    if bound is None:
                        raise CslCompileError(
                            f"{where}: `.{key} = {ref[1].name}`: the task is never bound to an ID"
                        )
                    opts[key] = bound
            resolved.append((op, (dsr, dsd, opts), where))
            continue
        if isinstance(tid, tuple):
            t = prog.task_fn(tid[1])
            if t is None:
                raise CslCompileError(f"{where}: @{op}({tid[1].name}): the task is never bound to an ID")
            tid = t
        resolved.append((op, tid, where))
    prog.startup = resolved
    for fn in list(prog.functions):
        comp.ensure_compiled(fn)
    check_program(comp, prog)
    check_code_and_data(prog)


def check_code_and_data(prog: Program) -> None:
    """Code and data share the PE's 48 KB: the program's arrays and variables plus its estimated
    code (csl_executor.codesize) must fit."""
    data = 2 * prog.memory_words
    code = program_code_bytes(prog)
    limit = 2 * PE_MEMORY_WORDS
    if data + code > limit:
        raise CslCompileError(
            f"{prog.path}:1: code and data exceed the PE's 48 KB: {data} B of data + about {code} B of "
            f"code ({codesize_breakdown(prog)}) = {data + code} B > {limit} B ({prog.memory_report()})"
        )


def check_program(comp: Compiler, prog: Program) -> None:
    rules = archs.rules(prog.arch)
    reserved = prog.native_state.get("reserved")
    if reserved:
        for tid, b in prog.tasks.items():
            if tid in reserved["tasks"]:
                raise CslCompileError(
                    f"{b.where}: task ID {tid} is an entrypoint of collectives_2d ({reserved['tasks'][tid]})"
                )
        for (kind, q), colors in prog.queue_uses.items():
            if q in reserved["queues"]:
                raise CslCompileError(
                    f"{next(iter(colors.values()))}: {kind} queue {q} is given to collectives_2d ({reserved['queues'][q]})"
                )
    for (kind, qid), colors in prog.queue_uses.items():
        # On WSE-3 @initialize_queue binds a queue to one color for the whole run. On WSE-2 an
        # operation's fabric DSD names its queue and color, so a queue may serve several colors one
        # after another (WaferLLM's MeshGEMM, 25-pt-stencil's output queues); the SDK asks that the
        # queue be empty before it is reused, which csl_executor.pe checks when an operation starts.
        if len(colors) > 1 and rules.name == "wse3":
            listing = "; ".join(f"color {c} at {w}" for c, w in sorted(colors.items()))
            raise CslCompileError(
                f"{next(iter(colors.values()))}: {kind} queue {qid} serves {len(colors)} colors ({listing}): "
                "one color per queue"
            )
        if rules.name == "wse3":
            # An unbound queue is an error only when an operation uses it (csl_executor.pe checks that):
            # programs declare DSDs for directions an edge PE never uses (residual: color 15).
            color = next(iter(colors))
            bound = prog.queue_colors.get((kind, qid))
            if bound is not None and bound[0] != color:
                raise CslCompileError(
                    f"{colors[color]}: {kind} queue {qid} is bound to color {bound[0]} ({bound[1]}), not {color}"
                )
    if rules.name == "wse3":
        for tid, b in prog.tasks.items():
            if b.kind == "data" and ("input", tid) not in prog.queue_colors:
                raise CslCompileError(
                    f"{b.where}: on WSE-3 the data task's input queue {tid} needs @initialize_queue"
                )


def merge_routes(c: CompiledLayout) -> dict[tuple[int, int, int], ColorConfig]:
    routes = dict(c.layout.routes)
    memcpy = c.options.memcpy
    stream_colors = set(c.layout.memcpy_colors.values())
    for (x, y), prog in c.pe_program.items():
        for cid, cfg in prog.local_colors.items():
            key = (x, y, cid)
            if key in routes:
                raise CslCompileError(
                    f"{cfg.where}: color {cid} at PE ({x}, {y}) is configured by the layout ({routes[key].where}) "
                    "and by @set_local_color_config"
                )
            routes[key] = cfg
    for (x, y, cid), cfg in routes.items():
        archs.check_routed_color(c.options.arch, cid, cfg.where, memcpy)
        reserved = c.pe_program[(x, y)].native_state.get("reserved") if (x, y) in c.pe_program else None
        if reserved and cid in reserved["colors"]:
            raise CslCompileError(
                f"{cfg.where}: color {cid} at PE ({x}, {y}) belongs to collectives_2d ({reserved['colors'][cid]})"
            )
        if cid in stream_colors:
            raise CslCompileError(
                f"{cfg.where}: color {cid} is a memcpy streaming color; memcpy routes it, the program must not"
            )
    return routes


def check_layout(c: CompiledLayout) -> None:
    rules = archs.rules(c.options.arch)
    w, h = c.rectangle
    # Exported names: each must exist, with one type, on the PEs that export it.
    for name, (t, _mutable, where) in c.layout.export_names.items():
        found = [(xy, p.exports[name]) for xy, p in c.pe_program.items() if name in p.exports]
        if not found:
            # cslc accepts a name no PE exports (WaferLLM's layouts declare some); the host's
            # get_id of it is what fails.
            c.warnings.append(f"{where}: @export_name({name!r}): no PE program exports it")
            continue
        for (x, y), exp in found:
            if isinstance(t, PointerType):
                if exp.kind != "data":
                    raise CslCompileError(
                        f"{exp.where}: {name!r} is exported as a function, the layout says data"
                    )
                assert exp.elem is not None  # a "data" export always carries its element type
                if exp.elem.words != t.elem.words or exp.elem.name != t.elem.name:
                    raise CslCompileError(
                        f"{exp.where}: {name!r} points to {exp.elem.name} on PE ({x}, {y}), the layout says {t.elem.name}"
                    )
            elif exp.kind != "fn":
                raise CslCompileError(
                    f"{exp.where}: {name!r} is exported as data, the layout says a function"
                )
    # WSE-2: colors and task IDs share one ID space; a color that reaches a PE's RAMP must not be the ID
    # of a local or control task on that PE.
    if rules.name == "wse2":
        memcpy_colors = set(c.layout.memcpy_colors.values())
        to_ramp: dict[tuple[int, int], set[int]] = {}  # each PE's colors that reach its RAMP
        for (px, py, cid), cfg in c.routes.items():
            if "RAMP" in cfg.tx:
                to_ramp.setdefault((px, py), set()).add(cid)
        for (x, y), prog in c.pe_program.items():
            ramp_colors = to_ramp.get((x, y), set()) | memcpy_colors
            for tid, b in prog.tasks.items():
                if b.kind in ("local", "control") and tid in ramp_colors:
                    raise CslCompileError(
                        f"{b.where}: on WSE-2 colors and task IDs share one ID space: {b.kind} task ID {tid} "
                        f"is also color {tid}, which reaches PE ({x}, {y})'s RAMP"
                    )


def _switch_tx(cfg: ColorConfig) -> tuple[str, ...]:
    if cfg.switches is None:
        return ()
    out: list[str] = []
    for pos in ("pos1", "pos2", "pos3"):
        p = cfg.switches.get(pos)
        if isinstance(p, Struct) and p.has("tx"):
            from csl_executor.types import Direction

            v = p.get("tx")
            out.extend([v.name] if isinstance(v, Direction) else [d.name for d in v.values()])
    return tuple(out)
