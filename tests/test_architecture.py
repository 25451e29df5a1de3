"""docs/ARCHITECTURE.md matches the code: every module it names exists, every module of the packages and of tools/ is
named, no library imports a layer above it (infer never imports train or the command line; layerskip_core imports
neither; no package imports tools/ or scripts/, and tools/ never scripts/), infer's subpackages import only those below
them, and no module imports one that imports it back."""

import ast
import re
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
PACKAGES = ("layerskip_core", "infer", "train", "layerskip_cli")
"""The product: what the wheel installs."""
LAB = "tools"
"""The lab on top of the product: imports the packages, never imported by them, not installed."""
DOC = REPO / "docs" / "ARCHITECTURE.md"


def package_modules() -> set[str]:
    """Every module file of the packages and of tools/, as a repository path (package faces and the kernel folder's
    __init__.py are named by their folder; tools/ names its own face)."""
    out = {f"{LAB}/__init__.py"}
    for package in (*PACKAGES, LAB):
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
        folders = re.findall(r"`((?:layerskip_core|infer|train|layerskip_cli|scripts|tools)/[\w/]+/)`", row)
        for folder in folders:
            names |= {folder + bare for bare in re.findall(r"`(\w+\.(?:py|sh))`", row)}
    return {n for n in names if n.split("/")[0] in (*PACKAGES, "scripts", LAB)}


def test_every_named_module_exists():
    text = DOC.read_text(encoding="utf-8")
    missing = sorted(p for p in named_paths(text) if not (REPO / p).exists())
    assert not missing, f"docs/ARCHITECTURE.md names what does not exist: {missing}"


def test_every_package_module_is_named():
    text = DOC.read_text(encoding="utf-8")
    named = named_paths(text)
    layerskip_cli_commands = {f"layerskip_cli/commands/{bare}" for bare in re.findall(r"`(\w+\.py)`", text)}
    section = text.split("### `scripts/`")[1].split("\n#")[0]
    scripts = {f"scripts/{bare}" for bare in re.findall(r"`(\w+\.(?:py|sh))`", section)}
    unnamed = sorted(package_modules() - named - layerskip_cli_commands)
    assert not unnamed, f"modules docs/ARCHITECTURE.md does not name: {unnamed}"
    on_disk = {p.relative_to(REPO).as_posix() for p in (REPO / "scripts").iterdir() if p.suffix in (".py", ".sh")}
    assert on_disk <= scripts, f"scripts docs/ARCHITECTURE.md does not name: {sorted(on_disk - scripts)}"
    lab = {p.relative_to(REPO).as_posix() for p in (REPO / LAB).rglob("*.sh")}
    assert lab <= named, f"tools/ programs docs/ARCHITECTURE.md does not name: {sorted(lab - named)}"


def imported_packages(path: Path) -> set[str]:
    tree = ast.parse(path.read_text(encoding="utf-8"))
    out = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out |= {a.name.split(".")[0] for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            out.add(node.module.split(".")[0])
    return out


def scripts_names() -> set[str]:
    """The programs of scripts/ by the name a sibling import would use."""
    return {p.stem for p in (REPO / "scripts").glob("*.py")}


def test_layers_import_only_downwards():
    """Each layer imports only those below it: tools/ on top (any package, never a script), the command line over
    the libraries, no package importing tools/ or a script."""
    off = {LAB, "scripts"} | scripts_names()
    above = {"layerskip_core": {"infer", "train", "layerskip_cli"} | off, "infer": {"train", "layerskip_cli"} | off,
             "train": {"infer", "layerskip_cli"} | off, "layerskip_cli": off, LAB: {"scripts"} | scripts_names()}
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
    for package in (*PACKAGES, LAB):
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
    return {module_name(p): p for package in (*PACKAGES, LAB) for p in (REPO / package).rglob("*.py")}


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


PRODUCT_ENTRIES = ("layerskip_cli.main", "layerskip_cli.__main__", "infer", "train.layerskip", "train.self_distill",
                   "infer.hf.custom_generate_folder.custom_generate.generate")
"""Where the product is entered: the console script, ``python -m layerskip_cli``, the Python API (``infer``, whose
public names load on first use: ``infer._EXPORTS``), the training entry, ``python -m train.self_distill`` and
``hf_generate``'s folder form."""
BEING_WIRED = {"infer.kernels.quant": "the quantized draft weights' format, which the quantized drafters being wired "
                                      "run (issue 65 item 1); until then the tests and tools/bench run it"}
"""Package modules the product does not reach yet, each with why it is in a package all the same."""


def api_exports() -> set[str]:
    """The modules ``infer``'s public names load from (``infer/__init__.py``'s ``_EXPORTS``, imported by name)."""
    tree = ast.parse((REPO / "infer" / "__init__.py").read_text(encoding="utf-8"))
    [table] = [n.value for n in ast.walk(tree) if isinstance(n, ast.Assign)
               and any(getattr(t, "id", None) == "_EXPORTS" for t in n.targets)]
    return {v.value for v in table.values}


def test_every_package_module_serves_the_product():
    """The wheel carries no lab code: every module of the packages is imported, directly or through others (function-
    local imports included), from one of the product's entries; what only the GPU check, a benchmark or an experiment
    runs lives in tools/."""
    graph = import_graph()
    graph["infer"] = graph["infer"] | api_exports()
    seen, todo = set(), list(PRODUCT_ENTRIES)
    while todo:
        module = todo.pop()
        if module in seen:
            continue
        seen.add(module)
        parts = module.split(".")
        todo += [".".join(parts[:i]) for i in range(1, len(parts))] + sorted(graph.get(module, ()))
    assert set(BEING_WIRED) <= set(graph), f"BEING_WIRED names what does not exist: {set(BEING_WIRED) - set(graph)}"
    lab = sorted(m for m in graph if m.split(".")[0] in PACKAGES and m not in seen and m not in BEING_WIRED)
    assert not lab, f"package modules the product never imports (lab code: move them to tools/): {lab}"


def drafter_names_in(node: ast.AST, names: set[str]) -> set[str]:
    """The registered drafters a literal list, tuple, set or dict names: as an element or key (``"swift"``), or as
    the first item of a (name, options) pair (``("swift", {...})``). Spec strings (``"swift:k=3"``) are inputs of
    the tests that parse them, not names."""
    if isinstance(node, ast.Dict):
        items = [k for k in node.keys if k is not None] + list(node.values)
    elif isinstance(node, (ast.List, ast.Tuple, ast.Set)):
        items = node.elts
    else:
        return set()
    found = set()
    for item in items:
        if isinstance(item, ast.Tuple) and item.elts:
            item = item.elts[0]
        if isinstance(item, ast.Constant) and item.value in names:
            found.add(item.value)
    return found


LIST_SIZE = 3
"""A literal naming this many registered drafters or more is a list of drafters (two is a comparison: plain decoding
and one drafter, or two drafters side by side)."""


def test_no_list_of_drafters_outside_the_registry():
    """A drafter is one file and one registry entry: every list of drafters (the tests that run every drafter, the GPU
    check and comparison) comes from ``infer.drafters.registry`` (``DRAFTERS``, ``example_cases``), so adding a
    drafter needs no edit elsewhere. The documentation may name them."""
    from infer.drafters.registry import DRAFTERS

    names, lists = set(DRAFTERS), []
    own = REPO / "infer" / "drafters" / "registry.py"
    for folder in (*PACKAGES, LAB, "scripts", "tests"):
        for path in sorted((REPO / folder).rglob("*.py")):
            if path == own:
                continue
            for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
                found = drafter_names_in(node, names)
                if len(found) >= LIST_SIZE:
                    lists.append(f"{path.relative_to(REPO)}:{node.lineno} {sorted(found)}")
    assert not lists, f"lists of drafters outside the registry (take them from example_cases): {lists}"
