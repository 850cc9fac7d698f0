"""The layout tells the runtime (docs/design.md, "Layout by runtime"), proven on the imports.

service/host/  the host's system python3: stdlib, the collection's module_utils, service.host.
service/venv/  a product venv's python: may also import what that venv holds, and service.host.
controller/    the controller only: anything, and never shipped to a host.
"""

from __future__ import annotations

import ast
import re
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
MODULE_UTILS = "ansible_collections.gptoss.host.plugins.module_utils"
# What each venv is for: the packages service/venv/ may import (vLLM's venv, the router's venv).
VENV_PACKAGES = {"vllm", "torch", "vllm_router", "safetensors", "numpy"}


def optional_import_nodes(tree: ast.AST) -> set[int]:
    """Imports inside a `try` whose handler takes ImportError (or wider): the code runs without them."""
    optional: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Try) and any(
                handler.type is None or any(isinstance(n, ast.Name) and n.id in {"ImportError", "Exception"}
                                            for n in ast.walk(handler.type))
                for handler in node.handlers):
            optional.update(id(inner) for stmt in node.body for inner in ast.walk(stmt))
    return optional


def imported_modules(path: Path, include_optional: bool = True) -> set[str]:
    """Every absolute module name a file imports, at any depth (lazy imports count too)."""
    tree = ast.parse(path.read_text(), str(path))
    skip = set() if include_optional else optional_import_nodes(tree)
    names: set[str] = set()
    for node in ast.walk(tree):
        if id(node) in skip:
            continue
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names.add(node.module)
    return names


def foreign_imports(path: Path, allowed_prefixes: tuple[str, ...], allowed_top: set[str]) -> list[str]:
    stdlib = set(sys.stdlib_module_names)
    return sorted(name for name in imported_modules(path, include_optional=False)
                  if name.split(".")[0] not in stdlib | allowed_top
                  and not name.startswith(allowed_prefixes))


@pytest.mark.parametrize("path", sorted((ROOT / "service" / "host").glob("*.py")), ids=lambda p: p.name)
def test_host_code_needs_only_the_system_python(path: Path) -> None:
    assert foreign_imports(path, ("service.host", MODULE_UTILS, "__future__"), set()) == []


@pytest.mark.parametrize("path", sorted((ROOT / "service" / "venv").glob("*.py")), ids=lambda p: p.name)
def test_venv_code_needs_only_its_venv(path: Path) -> None:
    assert foreign_imports(path, ("service.host", "service.venv", MODULE_UTILS, "__future__"), VENV_PACKAGES) == []


def test_nothing_shipped_to_a_host_imports_controller_code() -> None:
    shipped = [*(ROOT / "service").rglob("*.py"),
               *(ROOT / "collections" / "ansible_collections" / "gptoss" / "host" / "plugins").rglob("*.py")]
    offenders = {str(p.relative_to(ROOT)): sorted(n for n in imported_modules(p) if n.split(".")[0] == "controller")
                 for p in shipped}
    assert {k: v for k, v in offenders.items() if v} == {}


TEMPLATE_REF = re.compile(r"role_path \| dirname \| dirname\)? (?:\}\}|~ ')/templates/([\w./@-]+\.j2)")


def test_every_template_a_role_names_is_in_templates_and_every_one_is_used() -> None:
    named = {match for path in (ROOT / "roles").rglob("*.yml") for match in TEMPLATE_REF.findall(path.read_text())}
    present = {str(p.relative_to(ROOT / "templates")) for p in (ROOT / "templates").rglob("*.j2")}
    assert named == present
    assert not list((ROOT / "roles").glob("*/templates")), "templates live in the top-level templates/ only"
    bare = [f"{p.relative_to(ROOT)}: {line.strip()}" for p in (ROOT / "roles").rglob("*.yml")
            for line in p.read_text().splitlines() if re.search(r"src:\s*[\w.-]+\.j2\s*$", line)]
    assert bare == []
