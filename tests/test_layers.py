"""The packages of cachefs/ are layers: a module imports only from its own package, the ones
below it, and the shared modules at the top of cachefs/ (ARCHITECTURE.md draws them)."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

pytestmark = [pytest.mark.fast, pytest.mark.timeout(30)]

PACKAGE = Path(__file__).resolve().parent.parent / "cachefs"
# Lowest first.  "" is the shared vocabulary: cachefs/attr.py, errors.py, sizes.py,
# metrics.py, remotewait.py, limits.py.
LAYERS = ["", "kernel", "store", "remote", "peer", "prefetch", "mirror", "control", "service"]
ENTRY_POINT = "__main__"  # python -m cachefs: the command line, so at the top


def layer_of(module: str) -> int:
    """The layer of a module named ``cachefs[.package][.module]``."""
    parts = module.split(".")[1:]
    if parts == [ENTRY_POINT]:
        return len(LAYERS) - 1
    if len(parts) >= 2:
        return LAYERS.index(parts[0])
    if parts and parts[0] in LAYERS:
        return LAYERS.index(parts[0])  # the package itself
    return 0


def module_name(path: Path) -> str:
    relative = path.relative_to(PACKAGE.parent).with_suffix("")
    parts = list(relative.parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def imports_of(path: Path) -> list[str]:
    """The cachefs modules ``path`` imports (``from cachefs.x import y`` names cachefs.x.y
    when that is a module)."""
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found += [a.name for a in node.names if a.name.split(".")[0] == "cachefs"]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module \
                and node.module.split(".")[0] == "cachefs":
            for alias in node.names:
                candidate = f"{node.module}.{alias.name}"
                as_path = PACKAGE.parent / (candidate.replace(".", "/") + ".py")
                found.append(candidate if as_path.exists() else node.module)
    return found


def test_every_package_is_a_known_layer():
    packages = sorted(p.name for p in PACKAGE.iterdir()
                      if p.is_dir() and (p / "__init__.py").exists())
    assert packages == sorted(name for name in LAYERS if name)


def test_no_module_imports_a_layer_above_its_own():
    upward = []
    for path in sorted(PACKAGE.rglob("*.py")):
        importer = module_name(path)
        for imported in imports_of(path):
            if layer_of(imported) > layer_of(importer):
                upward.append(f"{importer} imports {imported}")
    assert upward == []


def test_each_package_says_what_it_may_import():
    for name in LAYERS[1:]:
        doc = ast.get_docstring(ast.parse((PACKAGE / name / "__init__.py").read_text()))
        assert doc and "May import" in doc, f"cachefs/{name}/__init__.py"
