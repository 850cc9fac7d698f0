#!/usr/bin/python
"""Ansible module: check the vLLM service's inputs against the host before anything changes (read-only)."""

from __future__ import annotations

DOCUMENTATION = r"""
---
module: vllm_inputs
short_description: Refuse bad vLLM service inputs before any role changes the host (read-only)
description:
  - The first validation step of a converge (playbooks/validate.yml, through vllm_service's
    tasks/validate.yml) asks the host once, before any role has changed anything. Every problem
    found is named in one message; nothing is written, so it also runs in check mode.
  - The API key - the rule systemd and HTTP impose (module_utils/unit_inputs.py, the one the
    rollout's gptoss.host.vllm_change applies again when it writes the key), and off loopback a key
    of 16+ characters.
  - Each port - held by a process outside the unit that will serve on it (unit_inputs.port_conflict,
    the rollout's own test).
  - The versioned venv these inputs want (module_utils/venv_store.py) - whether it is complete
    already; when it must be built, whether the wheelhouse is a folder on the host and whether the
    free space reaches I(min_free_mib) (the rule gptoss.host.vllm_venv applies before a build).
options:
  api_key: {description: The API key ('' = none)., type: str, default: '', no_log: true}
  host: {description: The address the server binds., type: str, required: true}
  ports:
    description: "Each serving unit and its port: {unit, port}."
    type: list
    elements: dict
    required: true
  wheelhouse_dir:
    description: "The wheel folder on the host ('' = not a wheelhouse install)."
    type: path
    default: ''
  lib_dir:
    description: Where gptoss_base ships the host-side code (asked whether it is there).
    type: path
    default: /opt/gptoss/lib
  model_dir: {description: The model folder (asked whether its config.json is there)., type: path, default: ''}
extends_documentation_fragment: [gptoss.host.venv_inputs]
author: gptoss-host
"""

EXAMPLES = r"""
- name: Check the service's inputs before anything changes
  gptoss.host.vllm_inputs:
    api_key: "{{ vllm_service_api_key }}"
    host: 127.0.0.1
    ports: [{unit: gptoss-vllm.service, port: 8000}]
    package: vllm
    version: "0.33.0"
"""

RETURN = r"""
venv: {description: The versioned venv these inputs want, type: str, returned: always}
venv_complete: {description: Whether it is complete already (no build needed), type: bool, returned: always}
problems: {description: What is refused, one sentence each (empty - all good), type: list, returned: always}
lib_ready:
  description: The host-side code (service.host.install_fit, service.venv.vllm_flags) is there, from the last converge.
  type: bool
  returned: always
model_ready:
  description: The model folder holds config.json (the flags' engine check reads it).
  type: bool
  returned: always
"""

import os

from ansible.module_utils.basic import AnsibleModule
from ansible_collections.gptoss.host.plugins.module_utils import unit_inputs, venv_store


def problems_of(params: dict) -> tuple[list[str], str, bool]:
    problems = []
    try:
        unit_inputs.secrets_file_text(params["api_key"])
    except ValueError as exc:
        problems.append(str(exc))
    exposure = unit_inputs.exposure_problem(params["host"], params["api_key"])
    if exposure:
        problems.append(exposure)
    for entry in params["ports"]:
        port, unit = int(entry["port"]), str(entry["unit"])
        if not 1 <= port <= 65535:
            problems.append(f"{unit}: port {port} is not 1-65535")
            continue
        holder = unit_inputs.port_conflict(port, unit, params["host"])
        if holder:
            problems.append(f"{params['host']}:{port} is held by {holder}, not by {unit}. Free the port or "
                            "choose another vllm_service_port")
    digest = venv_store.inputs_hash(params["package"], params["version"], params["pip_args"],
                                    params["remove_packages"], params["system_python"])
    try:
        venv = os.path.join(params["venvs_dir"], venv_store.venv_name(params["package"], params["version"], digest))
    except ValueError as exc:
        return [*problems, f"vllm_service_package/vllm_service_version: {exc}"], "", False
    complete = venv_store.read_manifest(venv) is not None
    if not complete:
        if params["wheelhouse_dir"] and not os.path.isdir(params["wheelhouse_dir"]):
            problems.append(f"vllm_service_wheelhouse_dir {params['wheelhouse_dir']} is not a folder on this host")
        space = venv_store.space_problem(params["venvs_dir"], params["min_free_mib"], params["package"],
                                         params["version"])
        if space:
            problems.append(space)
    return problems, venv, complete


def main() -> None:
    module = AnsibleModule(
        argument_spec={
            "api_key": {"type": "str", "default": "", "no_log": True},
            "host": {"type": "str", "required": True},
            "ports": {"type": "list", "elements": "dict", "required": True},
            **venv_store.VENV_INPUT_SPEC,
            "wheelhouse_dir": {"type": "path", "default": ""},
            "lib_dir": {"type": "path", "default": "/opt/gptoss/lib"},
            "model_dir": {"type": "path", "default": ""},
        },
        supports_check_mode=True,
    )
    problems, venv, complete = problems_of(module.params)
    params = module.params
    result = {"changed": False, "venv": venv, "venv_complete": complete, "problems": problems,
              "lib_ready": all(os.path.isfile(os.path.join(params["lib_dir"], *part.split("/")))
                               for part in ("service/host/install_fit.py", "service/venv/vllm_flags.py")),
              "model_ready": bool(params["model_dir"]) and os.path.isfile(os.path.join(params["model_dir"],
                                                                                     "config.json"))}
    if problems:
        module.fail_json(msg="vllm_service: refused before anything changed: " + "; ".join(problems)
                             + "; nothing was changed", **result)
    module.exit_json(**result)


if __name__ == "__main__":
    main()
