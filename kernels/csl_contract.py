"""What the CSL sources declare, read without a compiler: params, exports, module imports, array sizes.

Used by the contract lint (tests/test_csl_contract.py): every `param` is supplied by whoever
instantiates the file (the layout's @set_tile_code structs, an @import_module struct, or the cslc
command line), every host-visible name is exported, and the arrays a PE program declares have the
sizes and types the plan's memory map (`wafer.plan` Region.symbols) gives them.
"""

from __future__ import annotations

import re
from pathlib import Path

KERNEL_DIR = Path(__file__).resolve().parent
GENERATED = "plan_params.csl"

_COMMENT = re.compile(r"//[^\n]*")
_PARAM = re.compile(r"^\s*param\s+([A-Za-z_]\w*)\s*(?::\s*([^=;]+?))?\s*(=\s*[^;]+)?;", re.MULTILINE)
_EXPORT_SYMBOL = re.compile(r"@export_symbol\(\s*([A-Za-z_]\w*)\s*(?:,\s*\"(\w+)\")?\s*\)")
_EXPORT_NAME = re.compile(r"@export_name\(\s*\"(\w+)\"")
_IMPORT = re.compile(r"@import_module\(\s*\"([\w./]+\.csl)\"\s*(?:,\s*\.\{)?")
_ZEROS = re.compile(r"^var\s+(\w+)\s*=\s*@zeros\(\[([^\]]+)\](\w+)\)\s*;", re.MULTILINE)
_CONST = re.compile(r"^const\s+(\w+)\s*(?::\s*\w+)?\s*=\s*([^;]+);", re.MULTILINE)
_TYPE_ALIAS = re.compile(
    r"^const\s+(\w+)\s*:\s*type\s*=\s*if\s*\((\w+)\s*==\s*1\)\s*(\w+)\s+else\s+(\w+)\s*;", re.MULTILINE
)
_TILE_CODE = re.compile(r"@set_tile_code\([^;]*?\"(\w+\.csl)\"\s*,\s*@concat_structs\(\s*base\s*,\s*")
_SAFE_EXPR = re.compile(r"^[\w\s*+\-/()%]+$")


def source(name: str) -> str:
    return _COMMENT.sub("", (KERNEL_DIR / name).read_text())


def params(name: str) -> dict[str, bool]:
    """param name -> has a default."""
    return {m.group(1): m.group(3) is not None for m in _PARAM.finditer(source(name))}


def exported_symbols(name: str) -> set[str]:
    return {m.group(2) or m.group(1) for m in _EXPORT_SYMBOL.finditer(source(name))}


def exported_names(name: str = "layout.csl") -> set[str]:
    return set(_EXPORT_NAME.findall(source(name)))


def struct_fields(text: str) -> set[str]:
    """Field names of the struct literals in `text` (`.name = ...`)."""
    return set(re.findall(r"\.([A-Za-z_]\w*)\s*=", text))


def import_sites(name: str) -> list[tuple[str, set[str]]]:
    """(imported file, fields of its params struct) for every @import_module of a .csl file."""
    text = source(name)
    sites = []
    for m in _IMPORT.finditer(text):
        if m.group(1) == GENERATED:
            continue  # written by wafer/compile.py: constants only, no params
        body = _balanced(text, m.end() - 1) if text[m.end() - 1] == "{" else ""
        sites.append((m.group(1), struct_fields(body)))
    return sites


def function_struct(name: str, function: str) -> set[str]:
    """Fields of the struct a layout helper (`fn gemv_params(...) comptime_struct`) returns last."""
    text = source(name)
    start = text.index(f"fn {function}(")
    end = text.index("\nfn ", start + 1) if "\nfn " in text[start + 1 :] else len(text)
    ret = text.rindex("return .{", start, end)
    return struct_fields(_balanced(text, ret + len("return .")))


def tile_code_structs(name: str = "layout.csl") -> dict[str, set[str]]:
    """PE program file -> the params the layout passes it (besides memcpy_params)."""
    text = source(name)
    out: dict[str, set[str]] = {}
    for m in _TILE_CODE.finditer(text):
        rest = text[m.end() :]
        if rest.startswith(".{"):
            out[m.group(1)] = struct_fields(_balanced(rest, 1))
        else:
            out[m.group(1)] = function_struct(name, re.match(r"(\w+)\(", rest).group(1))
    return out


def _balanced(text: str, open_at: int) -> str:
    depth = 0
    for i in range(open_at, len(text)):
        depth += {"{": 1, "}": -1}.get(text[i], 0)
        if depth == 0:
            return text[open_at : i + 1]
    raise ValueError("unbalanced braces")


def arrays(name: str) -> dict[str, tuple[str, str]]:
    """Top-level array name -> (element count expression, element type name) of a .csl file."""
    return {m.group(1): (m.group(2).strip(), m.group(3)) for m in _ZEROS.finditer(source(name))}


def element_type(name: str, type_name: str, values: dict[str, int]) -> str:
    """A declared element type with the file's `if (flag == 1) f16 else f32` aliases resolved."""
    for m in _TYPE_ALIAS.finditer(source(name)):
        if m.group(1) == type_name:
            return m.group(3) if values[m.group(2)] == 1 else m.group(4)
    return type_name


def evaluate(expr: str, name: str, values: dict[str, int]) -> int:
    """Evaluate a CSL size expression with the file's simple integer consts and the given params."""
    env = {k: int(v) for k, v in values.items() if isinstance(v, bool | int)}
    for m in _CONST.finditer(source(name)):
        const, rhs = m.group(1), m.group(2).strip()
        if _SAFE_EXPR.match(rhs):
            try:
                env[const] = _eval(rhs, env)
            except NameError:
                pass
    return _eval(expr, env)


def _eval(expr: str, env: dict[str, int]) -> int:
    if not _SAFE_EXPR.match(expr):
        raise ValueError(f"not a plain integer expression: {expr!r}")
    return int(eval(expr.replace("/", "//"), {"__builtins__": {}}, env))  # noqa: S307 - checked above


# ----------------------------------------------------------------------------------------------------
# WSE-3 input queues

# On WSE-3 an input queue is bound to one color at a time (@initialize_queue, re-bound at run time with
# tile_config's encode_input_queue). A PE has 8 input queues, ids 0-7 (the limit issue 5 states; not
# confirmed here against the SDK's reference), and memcpy keeps 0 and 1 on every PE ("memcpy reserves input/output queue 0 and
# 1", SDK 2.10 tutorial topic 16), which also carry io.in's streaming channel. So a PE program may bind
# at most 6 more, each to one module instance: the stream.csl / reduce.csl instances run concurrently.
WSE3_INPUT_QUEUES = 8
MEMCPY_INPUT_QUEUES = frozenset({0, 1})
# Each instance of these modules binds exactly one input queue: the param named here (checked below,
# so a module that grew a queue per receive, as reduce.csl once had, fails the lint).
QUEUE_MODULES = {"stream.csl": "rx_queue", "reduce.csl": "in_queue"}
_GET_INPUT_QUEUE = re.compile(r"@get_input_queue\(\s*([^)]*?)\s*\)")


def input_queues(name: str, text: str | None = None) -> list[tuple[str, int]]:
    """(who binds it, queue id) for every input queue a PE program binds on WSE-3: its own
    `@get_input_queue(N)` and one per stream.csl / reduce.csl instance it imports. `text` replaces
    the file's source (the lint's negative tests)."""
    text = _COMMENT.sub("", text) if text is not None else source(name)
    found = []
    for m in _GET_INPUT_QUEUE.finditer(text):
        if not m.group(1).isdigit():
            raise ValueError(f"{name}: @get_input_queue({m.group(1)}) is not a literal queue id")
        found.append((f"{name} @get_input_queue", int(m.group(1))))
    for m in re.finditer(r"const\s+(\w+)\s*=\s*@import_module\(\s*\"(\w+\.csl)\"\s*,\s*\.\{", text):
        field = QUEUE_MODULES.get(m.group(2))
        if field is None:
            continue
        value = re.search(rf"\.{field}\s*=\s*(\d+)", _balanced(text, m.end() - 1))
        if value is None:
            raise ValueError(f"{name}: the {m.group(2)} instance `{m.group(1)}` sets no literal .{field}")
        found.append((f"{name} {m.group(1)} ({m.group(2)})", int(value.group(1))))
    return found


def wse3_queue_problems(sources: dict[str, str] | None = None) -> list[str]:
    """Why a PE program would bind more input queues than WSE-3 has, or one queue twice at once; empty
    when every program fits. `sources` (file name -> text) replaces files' sources."""
    sources = sources or {}
    problems = []
    for module, field in QUEUE_MODULES.items():
        uses = _GET_INPUT_QUEUE.findall(
            _COMMENT.sub("", sources[module]) if module in sources else source(module)
        )
        if uses != [field]:
            problems.append(
                f"{module} must bind exactly one input queue, @get_input_queue({field}); found {uses}"
            )
    programs = sorted(set(tile_code_structs()) | {"idle.csl"})
    for program in programs:
        bound = input_queues(program, sources.get(program))
        owners: dict[int, list[str]] = {}
        for who, queue in bound:
            owners.setdefault(queue, []).append(who)
        for queue, who in sorted(owners.items()):
            if not 0 <= queue < WSE3_INPUT_QUEUES:
                problems.append(
                    f"{program}: {who[0]} binds input queue {queue}; WSE-3 has ids 0-{WSE3_INPUT_QUEUES - 1}"
                )
            elif queue in MEMCPY_INPUT_QUEUES and any("@get_input_queue" not in w for w in who):
                problems.append(f"{program}: {', '.join(who)} binds input queue {queue}, which memcpy keeps")
            elif len(who) > 1:
                problems.append(f"{program}: input queue {queue} is bound by {len(who)} instances at once "
                                f"({', '.join(who)}); on WSE-3 a queue holds one color")  # fmt: skip
        total = len(set(owners) | MEMCPY_INPUT_QUEUES)
        if total > WSE3_INPUT_QUEUES:
            problems.append(f"{program}: a PE binds {total} input queues at once (memcpy's 2 included); "
                            f"WSE-3 has {WSE3_INPUT_QUEUES}")  # fmt: skip
    return problems
