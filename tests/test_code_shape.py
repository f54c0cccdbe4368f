"""The shape of the code that issue 38 set targets for, checked on every run so it stays true:
no import circles (imports inside functions counted), no import running up a layer inside
service/, no function over 60 lines but the few listed here, and no source file outside tests/
over 700 lines but the few listed here, none of which may grow; and the presentation layer of
issue 52: templates compute nothing, and bytes become text in service/units.py alone.

Read from the source with ast (and Jinja's parser) alone: nothing is imported or run.
"""

from __future__ import annotations

import ast
import re
from collections import defaultdict
from collections.abc import Iterator
from pathlib import Path

from jinja2 import Environment
from jinja2 import nodes as jinja_nodes

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("attention", "workers", "service", "bench", "scripts")
MAX_FUNCTION_LINES = 60
LONG_FUNCTIONS_ALLOWED: set[str] = set()
"""path::function of the functions allowed over MAX_FUNCTION_LINES: none since issue 38."""

MAX_FILE_LINES = 700
LONG_FILES_ALLOWED: dict[str, int] = {}
"""path: its line count when listed, for the source files over MAX_FILE_LINES still to be split.
A listed file may shrink (lower its count here; drop it once under the limit), never grow."""
SOURCE_SUFFIXES = (".py", ".html", ".js", ".css", ".sh", ".mako")
SKIPPED_DIRS = ("tests", "__pycache__", "node_modules")
"""Not source of ours: the tests, caches, and (found by name below) hidden and build folders
and virtual environments."""

SERVICE_LAYERS = {
    "service.db": 0,
    "service.core": 0,
    "service.units": 0,
    "service.spec": 1,
    "service.spec_cells": 1,
    "service.spec_docs": 1,
    "service.spec_expand": 1,
    "service.spec_fields": 1,
    "service.spec_limits": 1,
    "service.spec_mask": 1,
    "service.spec_models": 1,
    "service.spec_params": 1,
    "service.spec_structure": 1,
    "service.spec_values": 1,
    "service.results": 2,
    "service.leases": 2,
    "service.tenancy": 2,
    "service.artifacts": 2,
    "service.history": 2,
    "service.ray_status": 2,
    "service.api": 3,
    "service.scheduler": 3,
    "service.web": 4,
    "service.ray_driver": 4,
    "service.ray_supervisor": 4,
    "service.app": 5,
    "service.cli": 6,
    "service.capacity": 6,
    "service.client": 5,
    "service.regression": 5,
}
"""Lower layers never import higher ones: the database and config, the sweep spec, the results
home, the API, the dashboard, the app, the CLI (the client talks HTTP only)."""


def _modules() -> dict[str, Path]:
    found = {}
    for package in PACKAGES:
        for path in (ROOT / package).rglob("*.py"):
            if "migrations" in path.parts:
                continue
            name = ".".join(path.relative_to(ROOT).with_suffix("").parts)
            found[name.removesuffix(".__init__")] = path
    return found


def _imports(tree: ast.AST, modules: dict[str, Path]) -> Iterator[tuple[str, int]]:
    """The project modules an AST imports, anywhere in it (inside functions too): a name
    imported from a package counts as its submodule when it is one."""
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            yield from ((a.name, node.lineno) for a in node.names if a.name in modules)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            subs = [f"{node.module}.{a.name}" for a in node.names]
            if all(s in modules for s in subs):
                yield from ((s, node.lineno) for s in subs)
            elif node.module in modules:
                yield node.module, node.lineno


def _graph() -> dict[str, set[str]]:
    modules = _modules()
    graph: dict[str, set[str]] = defaultdict(set)
    for name, path in modules.items():
        for target, _ in _imports(ast.parse(path.read_text()), modules):
            if target != name:
                graph[name].add(target)
    return graph


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []
    for root in list(graph):
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph[child]))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1:
                    found.append(sorted(component))
    return found


def _layer(module: str) -> int | None:
    matches = [k for k in SERVICE_LAYERS if module == k or module.startswith(k + ".")]
    return SERVICE_LAYERS[max(matches, key=len)] if matches else None


def test_no_import_circles_with_imports_inside_functions_counted() -> None:
    assert _cycles(_graph()) == []


def test_the_cycle_finder_finds_a_circle() -> None:
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


def test_no_import_runs_up_a_layer_inside_service() -> None:
    modules = _modules()
    upward = []
    for name, path in modules.items():
        if not name.startswith("service.") or name == "service":
            continue
        mine = _layer(name)
        assert mine is not None, f"{name}: give it a layer in SERVICE_LAYERS"
        for target, line in _imports(ast.parse(path.read_text()), modules):
            theirs = _layer(target)
            if theirs is not None and theirs > mine:
                upward.append(f"{path.relative_to(ROOT)}:{line} imports {target}")
    assert upward == []


def test_functions_stay_under_60_lines() -> None:
    long = set()
    for path in _modules().values():
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                lines = (node.end_lineno or node.lineno) - node.lineno + 1
                if lines > MAX_FUNCTION_LINES:
                    long.add(f"{path.relative_to(ROOT)}::{node.name}")
    assert long <= LONG_FUNCTIONS_ALLOWED, sorted(long - LONG_FUNCTIONS_ALLOWED)


def _source_files(root: Path) -> Iterator[Path]:
    """The code and template files under `root`, tests and tooling folders left out."""
    for path in sorted(root.iterdir()):
        if path.is_dir():
            skipped = path.name.startswith(".") or path.name.endswith(".egg-info")
            if not (skipped or path.name in SKIPPED_DIRS or (path / "pyvenv.cfg").exists()):
                yield from _source_files(path)
        elif path.suffix in SOURCE_SUFFIXES:
            yield path


def _too_long(root: Path, allowed: dict[str, int]) -> list[str]:
    """One line per source file over MAX_FILE_LINES beyond its allowance (an allowed file past
    its recorded count, any other past the limit), naming it and what to do."""
    problems = []
    for path in _source_files(root):
        name = path.relative_to(root).as_posix()
        lines = len(path.read_text(errors="replace").splitlines())
        limit = allowed.get(name, MAX_FILE_LINES)
        if lines > limit:
            why = f"grew past its allowance of {limit}" if name in allowed else "is over"
            problems.append(
                f"{name}: {lines} lines {why} (limit {MAX_FILE_LINES}): split it into modules "
                "named for what they hold"
            )
    return problems


def test_no_source_file_outside_tests_passes_700_lines() -> None:
    assert _too_long(ROOT, LONG_FILES_ALLOWED) == []


def test_the_allowance_names_only_files_still_over_the_limit() -> None:
    """Each allowed file exists and still passes MAX_FILE_LINES: once split, its entry goes."""
    for name in LONG_FILES_ALLOWED:
        lines = len((ROOT / name).read_text().splitlines())
        assert lines > MAX_FILE_LINES, f"{name}: {lines} lines now; drop it from the list"


def test_the_length_check_names_a_long_file_and_a_grown_one(tmp_path: Path) -> None:
    (tmp_path / "pkg").mkdir()
    (tmp_path / "pkg" / "big.py").write_text("x = 1\n" * 701)
    (tmp_path / "pkg" / "grown.py").write_text("x = 1\n" * 705)
    (tmp_path / "pkg" / "fine.py").write_text("x = 1\n" * 700)
    (tmp_path / "tests").mkdir()
    (tmp_path / "tests" / "test_big.py").write_text("x = 1\n" * 900)
    (tmp_path / ".venv").mkdir()
    (tmp_path / ".venv" / "lib.py").write_text("x = 1\n" * 900)
    big = (
        "pkg/big.py: 701 lines is over (limit 700): split it into modules named for what they hold"
    )
    grown = (
        "pkg/grown.py: 705 lines grew past its allowance of 704 (limit 700): split it into "
        "modules named for what they hold"
    )
    assert _too_long(tmp_path, {"pkg/grown.py": 704}) == [big, grown]
    assert _too_long(tmp_path, {"pkg/grown.py": 705}) == [big]


# ---------------------------------------------------------------- the presentation layer

TEMPLATES = ROOT / "service" / "web" / "templates"
ARITHMETIC = (
    jinja_nodes.Add,
    jinja_nodes.Sub,
    jinja_nodes.Mul,
    jinja_nodes.Div,
    jinja_nodes.FloorDiv,
    jinja_nodes.Pow,
    jinja_nodes.Mod,
    jinja_nodes.Neg,
)
ORDERING = {"lt", "lteq", "gt", "gteq"}
INDEX_NAMES = {"loop", "page", "rank", "world_size"}
"""Positions, not measurements: a loop's counters, a list's page, a rank and the ring's size
(the next rank of a ring is (rank + 1) % world_size)."""


def _is_index(node: jinja_nodes.Node) -> bool:
    """An integer literal, a position (loop.<anything>, or a name or attribute in INDEX_NAMES),
    or arithmetic on those alone."""
    if isinstance(node, jinja_nodes.Const):
        return isinstance(node.value, int) and not isinstance(node.value, bool)
    if isinstance(node, jinja_nodes.Name):
        return node.name in INDEX_NAMES
    if isinstance(node, jinja_nodes.Getattr):
        loop = isinstance(node.node, jinja_nodes.Name) and node.node.name == "loop"
        return loop or node.attr in INDEX_NAMES
    if isinstance(node, jinja_nodes.BinExpr) and isinstance(node, ARITHMETIC):
        return _is_index(node.left) and _is_index(node.right)
    if isinstance(node, jinja_nodes.Neg):
        return _is_index(node.node)
    return False


def _computes(source: str) -> list[str]:
    """Where a template computes, one line each: arithmetic (+ - * / // % ** and unary minus,
    in any {{ }}, {% set %}, {% if %} or {% for %}) on anything but positions (_is_index), and
    an ordering comparison (< <= > >=) of two values, neither a literal nor a position (a
    derived flag, such as a peak below its inputs). Allowed: string formatting with a literal
    on the left ('%.2f' % x: formatting, not arithmetic), and filters (service.units)."""
    found = []
    tree = Environment().parse(source)
    for node in tree.find_all((jinja_nodes.BinExpr, jinja_nodes.UnaryExpr, jinja_nodes.Compare)):
        if isinstance(node, jinja_nodes.Compare):
            values = [node.expr, *(op.expr for op in node.ops)]
            ordered = any(op.op in ORDERING for op in node.ops)
            fixed = [isinstance(v, jinja_nodes.Const) or _is_index(v) for v in values]
            if ordered and not any(fixed):
                found.append(f"line {node.lineno}: compares two values")
            continue
        if not isinstance(node, ARITHMETIC) or _is_index(node):
            continue
        left = getattr(node, "left", None)
        formatting = isinstance(left, jinja_nodes.Const) and isinstance(left.value, str)
        if isinstance(node, jinja_nodes.Mod) and formatting:
            continue  # '%.2f' % x: formatting (its right side is checked on its own)
        found.append(f"line {node.lineno}: {type(node).__name__.lower()}")
    return found


def test_templates_compute_nothing() -> None:
    """A page shows the read model's figures through service.units' filters: every derived
    number (TFLOP/s per rank, a share, a flag) is a field of the read model, so a template
    never computes one."""
    problems = [
        f"{path.name} {where}"
        for path in sorted(TEMPLATES.glob("*.html"))
        for where in _computes(path.read_text())
    ]
    assert problems == []


def test_the_computing_check_finds_what_run_html_once_did() -> None:
    once = (
        "{{ '%.3f' % (r.flops / r.median_s / 1e12) if r.median_s else '—' }}"
        "{% if r.input_memory_bytes is not none and r.peak_memory_bytes < r.input_memory_bytes %}"
        "!{% endif %}{{ '%.0f%%' % (100 * row.efficiency) }}{% set x = a - b %}"
    )
    assert _computes(once) == [
        "line 1: div", "line 1: div", "line 1: compares two values", "line 1: mul", "line 1: sub",
    ]  # fmt: skip
    fine = (
        "{{ '%.2fx' % row.speedup }}{{ row.efficiency | percent }}{{ loop.index - 1 }}"
        "{{ (r.rank + 1) % row.world_size }}{% if page > 1 %}{{ page - 1 }}{% endif %}"
    )
    assert _computes(fine) == []


BINARY_UNIT = re.compile(r"\b[KMGT]iB\b")
BYTE_FORMATTERS_ALLOWED = {
    "service/units.py": "the one formatter of bytes",
    "service/web/static/app.js": "the browser's copy, for the rows a live sweep page adds",
}
"""The files that may name a binary unit in code, and why."""


def _binary_units(path: Path) -> list[int]:
    """The lines where a file names a binary unit (KiB, MiB, GiB, TiB) outside prose: in a
    Python string that is not a docstring (f-strings included), or anywhere in a template or
    script."""
    text = path.read_text()
    if path.suffix != ".py":
        return [i for i, line in enumerate(text.splitlines(), 1) if BINARY_UNIT.search(line)]
    tree = ast.parse(text)
    prose = {
        id(n.value)
        for n in ast.walk(tree)
        if isinstance(n, ast.Expr) and isinstance(n.value, ast.Constant)
    }
    return sorted(
        n.lineno
        for n in ast.walk(tree)
        if isinstance(n, ast.Constant)
        and isinstance(n.value, str)
        and id(n) not in prose
        and BINARY_UNIT.search(n.value)
    )


def test_bytes_are_formatted_only_in_units() -> None:
    """One formatter of bytes (service.units.nbytes and its units): a KiB, MiB, GiB or TiB
    written anywhere else in service/ is a second one."""
    found = []
    for path in _source_files(ROOT / "service"):
        name = path.relative_to(ROOT).as_posix()
        if "migrations" in path.parts or name in BYTE_FORMATTERS_ALLOWED:
            continue
        found += [f"{name}:{line}" for line in _binary_units(path)]
    assert found == []


def test_the_byte_check_reads_code_not_prose(tmp_path: Path) -> None:
    source = tmp_path / "x.py"
    source.write_text('"""Sizes in MiB."""\nA = 1\n"""1 GiB at most."""\nB = f"{A} KiB"\n')
    assert _binary_units(source) == [4]


MAX_TEMPLATE_LINE = 200
LONG_TEMPLATE_LINES_ALLOWED = {"sweep.html": 3}
"""Templates still holding lines over MAX_TEMPLATE_LINE characters, and how many: a number may
fall, never rise. A long line is wrapped with a Jinja comment holding the line break
(`...{#` then `#}...` on the next line), which renders nothing."""


def test_template_lines_stay_readable() -> None:
    long = {
        path.name: sum(len(line) > MAX_TEMPLATE_LINE for line in path.read_text().splitlines())
        for path in sorted(TEMPLATES.glob("*.html"))
    }
    over = {name: n for name, n in long.items() if n > LONG_TEMPLATE_LINES_ALLOWED.get(name, 0)}
    assert over == {}, f"lines over {MAX_TEMPLATE_LINE} characters: wrap them"


# ---- imports inside functions: counted, and in the CLI each one says why ----

FUNCTION_IMPORT_PACKAGES = ("attention", "workers", "service", "bench")
"""The packages whose non-test modules are counted (the database layer is service/db)."""
MAX_FUNCTION_IMPORTS = 45
"""The import statements inside functions over FUNCTION_IMPORT_PACKAGES: a ceiling that only
comes down (the aim is 60). One stays only for a reason: an optional package, a heavy import
kept off a start-up path, or rank-process only."""
REASON_REQUIRED_UNDER = ("service/cli/",)
"""Where each import inside a function carries its reason as a trailing comment."""


def _imports_in_functions(node: ast.AST, inside: bool = False) -> Iterator[ast.stmt]:
    """The import statements of an AST inside a function or method, each once however deep."""
    for child in ast.iter_child_nodes(node):
        if inside and isinstance(child, ast.Import | ast.ImportFrom):
            yield child
        in_function = inside or isinstance(child, ast.FunctionDef | ast.AsyncFunctionDef)
        yield from _imports_in_functions(child, in_function)


def _function_imports(root: Path) -> list[tuple[str, int, str]]:
    """(path, line, the statement's last source line) of each import inside a function in the
    non-test modules of FUNCTION_IMPORT_PACKAGES under `root`."""
    found = []
    for package in FUNCTION_IMPORT_PACKAGES:
        for path in sorted((root / package).rglob("*.py")):
            name = path.relative_to(root).as_posix()
            if set(SKIPPED_DIRS) & set(path.relative_to(root).parts):
                continue
            text = path.read_text()
            lines = text.splitlines()
            for node in _imports_in_functions(ast.parse(text)):
                found.append((name, node.lineno, lines[(node.end_lineno or node.lineno) - 1]))
    return found


def _without_reason(found: list[tuple[str, int, str]]) -> list[str]:
    """'path:line' of each import under REASON_REQUIRED_UNDER with no trailing comment."""
    return [
        f"{name}:{line}"
        for name, line, text in found
        if name.startswith(REASON_REQUIRED_UNDER) and "#" not in text
    ]


def test_imports_inside_functions_stay_under_the_ceiling() -> None:
    found = _function_imports(ROOT)
    listed = "\n".join(f"{name}:{line}: {text.strip()}" for name, line, text in found)
    assert len(found) <= MAX_FUNCTION_IMPORTS, (
        f"{len(found)} imports inside functions, over {MAX_FUNCTION_IMPORTS}: move them to the "
        f"top of their module unless one has a reason (say it in a comment):\n{listed}"
    )


def test_each_import_inside_a_cli_function_says_why() -> None:
    assert _without_reason(_function_imports(ROOT)) == []


def test_the_import_counter_counts_imports_inside_functions_only(tmp_path: Path) -> None:
    (tmp_path / "service" / "tests").mkdir(parents=True)
    (tmp_path / "service" / "cli").mkdir()
    (tmp_path / "service" / "m.py").write_text(
        "import os\n"
        "if os.name:\n    import json\n"
        "def f():\n    import re\n    def g():\n        from re import sub\n"
        "class C:\n    def h(self):\n        import csv\n"
    )
    (tmp_path / "service" / "tests" / "test_m.py").write_text("def t():\n    import os\n")
    (tmp_path / "service" / "cli" / "c.py").write_text(
        "def f():\n    import yaml  # heavy: kept off start-up\n\n\ndef g():\n    import json\n"
    )
    found = _function_imports(tmp_path)
    assert [(name, line) for name, line, _ in found] == [
        ("service/cli/c.py", 2),
        ("service/cli/c.py", 6),
        ("service/m.py", 5),
        ("service/m.py", 7),
        ("service/m.py", 10),
    ]
    assert _without_reason(found) == ["service/cli/c.py:6"]


# ---- kernel names in service/ and workers/ ------------------------------------------------------

NAMED_KERNELS_UNDER = ("service", "workers")
MAX_KERNEL_NAME_LITERALS = 2
KERNEL_NAME_LITERALS_ALLOWED = {
    "ulysses_groups:usp": "the Ulysses groups of a usp run's ranks, read from its "
    "ulysses_degree param (a fact of usp's params, not of a kernel family)",
    "_crossover:ring": "the compute/transfer crossover, whose closed form holds "
    "for the dense ring only (quadratic FLOPs, linear bytes per step)",
}
"""function:name of the built-in kernel names that service/ and workers/ may spell as string
literals (in that function, wherever its module), with the reason; everything else about a
kernel is read from its KernelSpec."""


def _builtin_kernel_names(root: Path) -> set[str]:
    """The `name` of every KernelSpec(...) or sharded_spec(...) (attention.ring.sharded) built
    under attention/ outside attention/adapters (the plugins'): a string, or a module-level
    NAME = "..." it names, given by keyword (sharded_spec: or as its first argument)."""
    names = set()
    for path in sorted((root / "attention").rglob("*.py")):
        if "adapters" in path.relative_to(root).parts:
            continue
        tree = ast.parse(path.read_text())
        constants = {
            target.id: node.value.value
            for node in tree.body
            if isinstance(node, ast.Assign) and isinstance(node.value, ast.Constant)
            for target in node.targets
            if isinstance(target, ast.Name)
        }
        for node in ast.walk(tree):
            if not (
                isinstance(node, ast.Call)
                and getattr(node.func, "id", "") in ("KernelSpec", "sharded_spec")
            ):
                continue
            given = [kw.value for kw in node.keywords if kw.arg == "name"]
            if getattr(node.func, "id", "") == "sharded_spec":
                given += node.args[:1]
            for value in given:
                if isinstance(value, ast.Constant):
                    names.add(value.value)
                elif isinstance(value, ast.Name):
                    names.add(constants[value.id])
    return names


def _docstrings(tree: ast.AST) -> set[int]:
    """id() of every docstring constant (module, class, function, and a name's docstring)."""
    found = set()
    for node in ast.walk(tree):
        body = getattr(node, "body", None)
        if not isinstance(body, list):
            continue
        for stmt in body:
            if isinstance(stmt, ast.Expr) and isinstance(stmt.value, ast.Constant):
                found.add(id(stmt.value))
    return found


def _enclosing_functions(tree: ast.AST) -> dict[int, str]:
    """id() of each node inside a function -> the innermost function's name ("" at module
    level: absent)."""
    inside: dict[int, str] = {}
    functions = [n for n in ast.walk(tree) if isinstance(n, ast.FunctionDef | ast.AsyncFunctionDef)]
    for function in functions:  # outer before inner (ast.walk is breadth-first): inner wins
        for node in ast.walk(function):
            inside[id(node)] = function.name
    return inside


def _kernel_name_literals(root: Path, names: set[str]) -> list[tuple[str, str]]:
    """(path, function:name) of each string literal (not a docstring) equal to a kernel name
    in the non-test modules of NAMED_KERNELS_UNDER (function "" at module level)."""
    found = []
    for package in NAMED_KERNELS_UNDER:
        for path in sorted((root / package).rglob("*.py")):
            if set(SKIPPED_DIRS) & set(path.relative_to(root).parts):
                continue
            tree = ast.parse(path.read_text())
            docs = _docstrings(tree)
            inside = _enclosing_functions(tree)
            found += [
                (path.relative_to(root).as_posix(), f"{inside.get(id(node), '')}:{node.value}")
                for node in ast.walk(tree)
                if isinstance(node, ast.Constant)
                and isinstance(node.value, str)
                and node.value in names
                and id(node) not in docs
            ]
    return sorted(found)


def test_service_and_workers_read_kernel_facts_from_the_registry() -> None:
    names = _builtin_kernel_names(ROOT)
    assert {"dense", "ring", "ulysses", "usp", "dilated", "block_sparse"} <= names
    found = _kernel_name_literals(ROOT, names)
    assert len(KERNEL_NAME_LITERALS_ALLOWED) <= MAX_KERNEL_NAME_LITERALS
    unlisted = [f"{path}: {at}" for path, at in found if at not in KERNEL_NAME_LITERALS_ALLOWED]
    assert unlisted == [], (
        "kernel names spelled in service/ or workers/: read the fact from the kernel's "
        f"KernelSpec (attention.registry) instead: {unlisted}"
    )
    assert len(found) <= MAX_KERNEL_NAME_LITERALS, found


def test_the_kernel_name_counter_skips_docstrings_and_tests(tmp_path: Path) -> None:
    (tmp_path / "attention" / "adapters").mkdir(parents=True)
    (tmp_path / "attention" / "k.py").write_text(
        'NAME = "wrapper"\nregister(KernelSpec(name="plain"))\nKernelSpec(name=NAME)\n'
    )
    (tmp_path / "attention" / "adapters" / "p.py").write_text('KernelSpec(name="plugin")\n')
    (tmp_path / "service" / "tests").mkdir(parents=True)
    (tmp_path / "service" / "m.py").write_text(
        '"""plain"""\nX = "plain"\n"""plain: a name\'s docstring"""\n'
        'def f():\n    """wrapper"""\n    return {"wrapper": "plugin"}\n'
    )
    (tmp_path / "service" / "tests" / "test_m.py").write_text('Y = "plain"\n')
    (tmp_path / "workers").mkdir()
    names = _builtin_kernel_names(tmp_path)
    assert names == {"plain", "wrapper"}
    assert _kernel_name_literals(tmp_path, names) == [
        ("service/m.py", ":plain"),
        ("service/m.py", "f:wrapper"),
    ]
