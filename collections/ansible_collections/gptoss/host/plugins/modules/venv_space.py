#!/usr/bin/python
"""Ansible module: refuse a venv install where its filesystem has too little room (read-only)."""

from __future__ import annotations

DOCUMENTATION = r"""
---
module: venv_space
short_description: Fail before a venv install where the filesystem that will hold it has too little room
description:
  - The rule of gptoss.host.vllm_venv (module_utils venv_store.space_problem), for a venv that another
    task installs (the webui role's, with ansible.builtin.pip).
  - Counts the space an unprivileged process may use (root's reserved blocks left out), because the
    service that runs from the venv writes its data as its own user.
  - I(path) may not exist yet; its nearest existing parent's filesystem is measured.
  - Changes nothing; supports check mode (it tells what a real run would refuse).
options:
  path: {description: Where the venv goes., type: path, required: true}
  package: {description: What is installed (for the message)., type: str, required: true}
  version: {description: Its version (for the message)., type: str, required: true}
  min_free_mib: {description: Free space the install needs., type: int, required: true}
  setting: {description: The role variable that sets I(min_free_mib) (for the message)., type: str, required: true}
  remedy: {description: What the user can do (ends the message)., type: str, default: Free space there.}
author: gptoss-host
"""

EXAMPLES = r"""
- name: Room for Open WebUI's venv
  gptoss.host.venv_space:
    path: /opt/gptoss/webui-venv
    package: open-webui
    version: "0.12.4"
    min_free_mib: 4096
    setting: webui_venv_min_free_gib
"""

RETURN = r"""
free_mib: {description: Free space where I(path) goes (MiB, unprivileged)., type: int, returned: always}
"""

from ansible.module_utils.basic import AnsibleModule
from ansible_collections.gptoss.host.plugins.module_utils import venv_store


def main() -> None:
    module = AnsibleModule(
        argument_spec=dict(
            path=dict(type="path", required=True),
            package=dict(type="str", required=True),
            version=dict(type="str", required=True),
            min_free_mib=dict(type="int", required=True),
            setting=dict(type="str", required=True),
            remedy=dict(type="str", default="Free space there."),
        ),
        supports_check_mode=True,
    )
    params = module.params
    free = venv_store.free_mib(params["path"])  # one reading, for the verdict and the returned value alike
    problem = venv_store.space_refusal(params["path"], free, params["min_free_mib"], params["package"],
                                       params["version"], setting=params["setting"], remedy=params["remedy"])
    if problem:
        module.fail_json(msg=problem, free_mib=free)
    module.exit_json(changed=False, free_mib=free)


if __name__ == "__main__":
    main()
