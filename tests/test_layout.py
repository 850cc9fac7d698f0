"""The layout tells the runtime (docs/design.md, "Layout by runtime"), proven on the imports.

service/host/  the host's system python3: stdlib, the collection's module_utils, service.host.
service/venv/  a product venv's python: may also import what that venv holds, and service.host.
module_utils/  everywhere (inside modules, beside service/): the standard library and each other only.
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
# What each venv is for: the packages service/venv/ may import (vLLM's venv, the router's venv, the GPU
# exporter's venv: prometheus_client; its pynvml is read through service.host.nvml_reader).
VENV_PACKAGES = {"vllm", "torch", "vllm_router", "safetensors", "numpy", "prometheus_client"}


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


MODULE_UTILS_DIR = ROOT / "collections" / "ansible_collections" / "gptoss" / "host" / "plugins" / "module_utils"
# Clients that one model source needs, imported lazily inside the function of that source only (the
# model_weights role runs them where it installed them); never at import time.
LAZY_SOURCE_CLIENTS = {"model_fetch.py": {"huggingface_hub", "modelscope"}}


def module_utils_imports(path: Path) -> tuple[set[str], set[str]]:
    """(module-level imports, imports inside functions) of a file, each as the absolute module names,
    a sibling named as MODULE_UTILS.<name> also when it is imported as `from MODULE_UTILS import name`."""
    tree = ast.parse(path.read_text(), str(path))
    lazy_nodes = {id(inner) for node in ast.walk(tree) if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef)
                  for inner in ast.walk(node)}
    top: set[str] = set()
    lazy: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names = {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names = ({f"{node.module}.{alias.name}" for alias in node.names} if node.module == MODULE_UTILS
                     else {node.module})
        elif isinstance(node, ast.ImportFrom):
            names = {f"<relative import level {node.level}>"}
        else:
            continue
        (lazy if id(node) in lazy_nodes else top).update(names)
    return top, lazy


@pytest.mark.parametrize("path", sorted(MODULE_UTILS_DIR.glob("*.py")), ids=lambda p: p.name)
def test_module_utils_need_only_the_standard_library_and_each_other(path: Path) -> None:
    """module_utils run inside every module (AnsiballZ) and on the host's system python3 beside
    service/: the standard library and sibling module_utils only (docs/design.md, "Layout by runtime")."""
    siblings = {f"{MODULE_UTILS}.{p.stem}" for p in MODULE_UTILS_DIR.glob("*.py")}
    stdlib = set(sys.stdlib_module_names) | {"__future__"}
    top, lazy = module_utils_imports(path)

    def foreign(names: set[str], allowed_top: set[str]) -> list[str]:
        return sorted(n for n in names if n.split(".")[0] not in stdlib | allowed_top
                      and not any(n == s or n.startswith(s + ".") for s in siblings))

    assert foreign(top, set()) == []
    assert foreign(lazy, LAZY_SOURCE_CLIENTS.get(path.name, set())) == []


def test_the_module_utils_rule_catches_a_foreign_import(tmp_path: Path) -> None:
    bad = tmp_path / "bad.py"
    bad.write_text(f"import yaml\nfrom {MODULE_UTILS} import nonexistent\nfrom ansible.module_utils.basic import X\n"
                   "def f():\n    import requests\n")
    top, lazy = module_utils_imports(bad)
    assert top == {"yaml", f"{MODULE_UTILS}.nonexistent", "ansible.module_utils.basic"} and lazy == {"requests"}
    with pytest.raises(AssertionError):
        test_module_utils_need_only_the_standard_library_and_each_other(bad)


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
