"""Load a program of scripts/ or tools/ as a module, afresh, for the tests that drive them (scripts are programs,
not a package; a tools program is loaded under its dotted name, tools.FOLDER.NAME)."""

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

REPO = Path(__file__).resolve().parents[1]
SCRIPTS = REPO / "scripts"
TOOLS = REPO / "tools"


def load_script(name: str) -> ModuleType:
    """``scripts/NAME.py`` as module ``NAME``, or the one ``tools/*/NAME.py`` as ``tools.FOLDER.NAME``, executed
    afresh and registered in sys.modules (dataclasses look their module up there) and as its package's attribute,
    so a program loaded after it that imports it (``from tools.gpu import lease``) gets this module: a test that
    patches it (``lease.REPO``) patches what the programs use."""
    path = SCRIPTS / f"{name}.py"
    if path.is_file():
        dotted = name
    else:
        [path] = TOOLS.glob(f"*/{name}.py")
        dotted = ".".join(path.relative_to(REPO).with_suffix("").parts)
    spec = importlib.util.spec_from_file_location(dotted, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[dotted] = module
    spec.loader.exec_module(module)
    if "." in dotted:
        package, _, leaf = dotted.rpartition(".")
        setattr(importlib.import_module(package), leaf, module)
    return module
