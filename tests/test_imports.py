"""The package's layers and which may import which (docs/architecture.md draws them)."""
import ast
import subprocess
import sys
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "src" / "expertrail"

# Each module's layer, by the first part of its path under src/expertrail.
LAYERS = {
    "facts": ["errors", "names"],
    "plan": ["plan"],
    "engine": ["comm", "kernels", "dispatch"],
    "model": ["moe", "balance"],
    "tools": ["tools", "emulation", "__main__", "__init__"],
}
# What each layer may import, besides itself.
ALLOWED = {
    "facts": set(),
    "plan": {"facts"},
    "engine": {"facts"},
    "model": {"facts", "engine"},
    "tools": {"facts", "plan", "engine", "model"},
}


def layer_of(module: str) -> str:
    """``dispatch.route`` -> ``engine``."""
    for layer, names in LAYERS.items():
        if module.split(".")[0] in names:
            return layer
    raise AssertionError(f"expertrail.{module} is in no layer: add it to LAYERS (and docs/architecture.md)")


def package_imports(path: Path) -> set:
    """The expertrail modules ``path`` imports (module level or inside functions), as dotted
    names relative to the package."""
    here = path.relative_to(PACKAGE).with_suffix("").parts
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom):
            if node.level:
                base = list(here[:len(here) - node.level])
                target = base + (node.module.split(".") if node.module else [])
                names = [".".join(target + [a.name]) for a in node.names] if not node.module else [".".join(target)]
                found.update(n for n in names if n)
            elif node.module and node.module.startswith("expertrail."):
                found.add(node.module.removeprefix("expertrail."))
        elif isinstance(node, ast.Import):
            found.update(a.name.removeprefix("expertrail.") for a in node.names if a.name.startswith("expertrail."))
    return found


def _modules():
    return sorted(p for p in PACKAGE.rglob("*.py") if "__pycache__" not in p.parts)


@pytest.mark.parametrize("path", _modules(), ids=lambda p: str(p.relative_to(PACKAGE)))
def test_imports_follow_the_layers(path):
    module = ".".join(path.relative_to(PACKAGE).with_suffix("").parts).removesuffix(".__init__") or "__init__"
    mine = layer_of(module)
    for target in sorted(package_imports(path)):
        theirs = layer_of(target)
        assert theirs == mine or theirs in ALLOWED[mine], \
            f"expertrail.{module} ({mine}) imports expertrail.{target} ({theirs}): {mine} may import " \
            f"{sorted(ALLOWED[mine]) or 'nothing else'}"


def test_the_engine_loads_without_the_planner():
    code = "import sys, expertrail.dispatch; print(sorted(m for m in sys.modules if m.startswith('expertrail.plan')))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]"


def test_the_old_module_names_import_the_moved_modules():
    """``expertrail.hf``, ``expertrail.launch``...: the modules that moved into subpackages,
    the same module objects (so monkeypatching either name patches both)."""
    import importlib

    import expertrail
    for old, new in expertrail._MOVED.items():
        assert importlib.import_module(f"expertrail.{old}") is importlib.import_module(f"expertrail.{new}"), old
