"""docs/ARCHITECTURE.md matches the code: every module it names exists, every package module is named, no library
imports a layer above it (infer never imports train or the command line; layerskip_core imports neither), infer's
subpackages import only those below them, and no module imports one that imports it back."""

import ast
import re
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
PACKAGES = ("layerskip_core", "infer", "train", "layerskip_cli")
DOC = REPO / "docs" / "ARCHITECTURE.md"


def package_modules() -> set[str]:
    """Every module file of the packages, as a repository path (package faces and the kernel folder's
    __init__.py are named by their folder)."""
    out = set()
    for package in PACKAGES:
        for path in (REPO / package).rglob("*.py"):
            rel = path.relative_to(REPO).as_posix()
            if path.name == "__init__.py":
                if path.parent.name == "kernels":
                    out.add(rel.removesuffix("__init__.py"))
                continue
            out.add(rel)
    return out


def named_paths(text: str) -> set[str]:
    """Paths in backticks, plus the files a `folder/` row lists by their bare names in the same cell."""
    names = set(re.findall(r"`([\w/.]+)`", text))
    for row in text.splitlines():
        folders = re.findall(r"`((?:layerskip_core|infer|train|layerskip_cli|scripts)/[\w/]+/)`", row)
        for folder in folders:
            names |= {folder + bare for bare in re.findall(r"`(\w+\.py)`", row)}
    return {n for n in names if n.split("/")[0] in PACKAGES + ("scripts",) or n.startswith("scripts/")}


def test_every_named_module_exists():
    text = DOC.read_text(encoding="utf-8")
    missing = sorted(p for p in named_paths(text) if not (REPO / p).exists())
    assert not missing, f"docs/ARCHITECTURE.md names what does not exist: {missing}"


def test_every_package_module_is_named():
    text = DOC.read_text(encoding="utf-8")
    named = named_paths(text)
    layerskip_cli_commands = {f"layerskip_cli/commands/{bare}" for bare in re.findall(r"`(\w+\.py)`", text)}
    scripts = {f"scripts/{bare}" for bare in re.findall(r"`(\w+\.(?:py|sh))`", text.split("## `scripts/`")[1])}
    unnamed = sorted(package_modules() - named - layerskip_cli_commands)
    assert not unnamed, f"modules docs/ARCHITECTURE.md does not name: {unnamed}"
    on_disk = {p.relative_to(REPO).as_posix() for p in (REPO / "scripts").iterdir() if p.suffix in (".py", ".sh")}
    assert on_disk <= scripts, f"scripts docs/ARCHITECTURE.md does not name: {sorted(on_disk - scripts)}"


def imported_packages(path: Path) -> set[str]:
    tree = ast.parse(path.read_text(encoding="utf-8"))
    out = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out |= {a.name.split(".")[0] for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            out.add(node.module.split(".")[0])
    return out


def test_layers_import_only_downwards():
    above = {"layerskip_core": {"infer", "train", "layerskip_cli"}, "infer": {"train", "layerskip_cli"},
             "train": {"infer", "layerskip_cli"}}
    wrong = []
    for package, forbidden in above.items():
        for path in (REPO / package).rglob("*.py"):
            bad = imported_packages(path) & forbidden
            if bad:
                wrong.append(f"{path.relative_to(REPO)} imports {sorted(bad)}")
    assert not wrong, wrong


def test_the_engine_does_not_import_its_measuring_tools():
    wrong = []
    for path in (REPO / "infer").rglob("*.py"):
        if "measure" in path.relative_to(REPO / "infer").parts:
            continue
        tree = ast.parse(path.read_text(encoding="utf-8"))
        for node in ast.walk(tree):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else \
                [node.module or ""] if isinstance(node, ast.ImportFrom) else []
            if any(n.startswith("infer.measure") for n in names):
                wrong.append(str(path.relative_to(REPO)))
    assert not wrong, f"engine modules import infer.measure: {wrong}"


def test_the_command_line_imports_no_measuring_tool_but_bench():
    """Only `layerskip bench` reads infer.measure's bench rooms; generate's stream totals come from the engine."""
    for path in (REPO / "layerskip_cli" / "commands").glob("*.py"):
        if path.name == "bench.py":
            continue
        modules = {n.module for n in ast.walk(ast.parse(path.read_text(encoding="utf-8")))
                   if isinstance(n, ast.ImportFrom) and n.module}
        rooms = {"infer.measure.bench", "infer.measure.report", "infer.measure.methods", "infer.measure.peers"}
        assert not modules & rooms, f"{path.name} imports {sorted(modules & rooms)}"


MAX_FILE_LINES = 500
MAX_FUNCTION_LINES = 60


def test_library_files_and_functions_are_short():
    long = []
    for package in PACKAGES:
        for path in sorted((REPO / package).rglob("*.py")):
            rel = path.relative_to(REPO).as_posix()
            text = path.read_text(encoding="utf-8")
            if len(text.splitlines()) > MAX_FILE_LINES:
                long.append(f"{rel}: {len(text.splitlines())} lines")
            for node in ast.walk(ast.parse(text)):
                if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                    lines = node.end_lineno - node.lineno + 1
                    if lines > MAX_FUNCTION_LINES:
                        long.append(f"{rel}:{node.lineno} {node.name}: {lines} lines")
    assert not long, f"over {MAX_FILE_LINES} lines a file or {MAX_FUNCTION_LINES} a function: {long}"


INFER_ORDER = (("kernels",), ("model",), ("assets",), ("drafters",), ("decode",), ("selfsd", "hf"), ("loading",),
               ("measure",))
"""infer/'s rooms (its subpackages and its top module loading.py) from the bottom up: a room imports only rooms on
an earlier line (docs/ARCHITECTURE.md); the two rooms on one line import neither each other."""


def module_name(path: Path) -> str:
    parts = path.relative_to(REPO).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def project_modules() -> dict[str, Path]:
    return {module_name(p): p for package in PACKAGES for p in (REPO / package).rglob("*.py")}


def project_imports(path: Path, modules: dict[str, Path]) -> set[str]:
    """Every project module ``path`` imports anywhere in it (at the top, under TYPE_CHECKING, inside a function):
    ``from a.b import c`` is a.b.c where that is a module, else a.b."""
    out = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names = [f"{node.module}.{a.name}" if f"{node.module}.{a.name}" in modules else node.module
                     for a in node.names]
        else:
            continue
        out |= {n for n in names if n in modules}
    return out


def import_graph() -> dict[str, set[str]]:
    modules = project_modules()
    return {name: project_imports(path, modules) - {name} for name, path in modules.items()}


def infer_room(module: str) -> str | None:
    parts = module.split(".")
    return parts[1] if parts[0] == "infer" and len(parts) > 1 else None


def test_infer_rooms_import_in_their_order():
    rank = {room: i for i, line in enumerate(INFER_ORDER) for room in line}
    assert set(rank) == {p.name for p in (REPO / "infer").iterdir() if (p / "__init__.py").is_file()} | {"loading"}
    wrong = []
    for module, imports in import_graph().items():
        here = infer_room(module)
        for target in imports:
            there = infer_room(target)
            if here is None or there is None or here == there:
                continue
            if rank[there] >= rank[here]:
                wrong.append(f"{module} ({here}) imports {target} ({there})")
    assert not wrong, wrong


def test_no_module_imports_one_that_imports_it_back():
    """No import circle among the packages' modules, type-only and function-local imports included."""
    graph = import_graph()
    index, low, stack, on_stack, circles = {}, {}, [], set(), []

    def visit(v):  # Tarjan's strongly connected components
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while not component or component[-1] != v:
                component.append(stack.pop())
                on_stack.discard(component[-1])
            if len(component) > 1:
                circles.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    assert not circles, circles
