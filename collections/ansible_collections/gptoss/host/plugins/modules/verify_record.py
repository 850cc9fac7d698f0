#!/usr/bin/python
"""Ansible module: write a role's verify record (verify.d/<role>.json) through the verify contract."""

from __future__ import annotations

DOCUMENTATION = r"""
---
module: verify_record
short_description: Write what a role promised to verify.d/<role>.json, checked against the verify contract
description:
  - The record must keep the role's contract (module_utils/verify_contract.py) exactly, with no unknown
    key, no missing key and no wrong type; otherwise the module fails and leaves the file as it was.
  - The file is written atomically (0644, root) with sorted keys, so an unchanged record reports
    changed=false. Supports check mode and diff.
options:
  role: {description: The role whose record this is (a key of the contract)., type: str, required: true}
  record: {description: The record., type: dict, required: true}
  config_dir: {description: The verify.d folder., type: path, default: /etc/gptoss/verify.d}
author: gptoss-host
"""

EXAMPLES = r"""
- name: Record what verify must find
  gptoss.host.verify_record:
    role: cpu_governor
    record: {governor: performance}
"""

RETURN = r"""
path: {description: The record file, type: str, returned: always}
"""

import os

from ansible.module_utils.basic import AnsibleModule
from ansible_collections.gptoss.host.plugins.module_utils import atomic_file
from ansible_collections.gptoss.host.plugins.module_utils.verify_contract import (
    ContractError,
    check_record,
    record_path,
    render,
)


def main() -> None:
    module = AnsibleModule(
        argument_spec=dict(
            role=dict(type="str", required=True),
            record=dict(type="dict", required=True),
            config_dir=dict(type="path", default="/etc/gptoss/verify.d"),
        ),
        supports_check_mode=True,
    )
    params = module.params
    path = str(record_path(params["config_dir"], params["role"]))
    try:
        new = render(check_record(params["role"], params["record"]))
    except ContractError as err:
        module.fail_json(msg=f"{err}; {path} left as it was", path=path)
    old = ""
    if os.path.exists(path):
        with open(path) as handle:
            old = handle.read()
    result: dict = {"changed": old != new, "path": path}
    if module._diff:
        result["diff"] = {"before": old, "after": new, "before_header": path, "after_header": path}
    if result["changed"] and not module.check_mode:
        if not os.path.isdir(params["config_dir"]):
            module.fail_json(msg=f"{params['config_dir']} does not exist (the gptoss_base role creates it)", path=path)
        atomic_file.write_atomically(path, new, 0o644, owner_root=True)
    module.exit_json(**result)


if __name__ == "__main__":
    main()
