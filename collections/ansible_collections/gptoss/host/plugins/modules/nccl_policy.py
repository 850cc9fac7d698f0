#!/usr/bin/python
"""Ansible module: decide the NCCL environment of gptoss-vllm.service (read-only)."""

from __future__ import annotations

DOCUMENTATION = r"""
---
module: nccl_policy
short_description: Decide the NCCL variables for gptoss-vllm.service from the P2P policy and NVML
description:
  - Applies the project's one P2P rule (module_utils/nccl_policy.py) to the host's NVML report and
    returns the variables and the EnvironmentFile body. It changes nothing; the role writes the file.
  - C(auto) leaves P2P to NCCL only when NVML reports P2P OK for every GPU pair.
options:
  policy: {description: "auto, enable or disable.", type: str, required: true}
  nvml_report:
    description: The JSON printed by C(python3 -m service.host.nvidia --json) on the host; empty when it failed.
    type: str
    default: ""
  ib_disable: {description: Set NCCL_IB_DISABLE=1., type: bool, default: true}
  torch_async_error_handling: {description: TORCH_NCCL_ASYNC_ERROR_HANDLING value., type: str, default: "1"}
  extra: {description: Extra variables., type: dict, default: {}}
author: gptoss-host
"""

EXAMPLES = r"""
- name: Decide the NCCL variables
  gptoss.host.nccl_policy:
    policy: auto
    nvml_report: "{{ nvml.stdout }}"
  register: policy
"""

RETURN = r"""
p2p_disable: {description: Whether NCCL_P2P_DISABLE=1 is set, type: bool, returned: always}
reason: {description: Why, type: str, returned: always}
variables: {description: The variables as strings, type: dict, returned: always}
content: {description: The EnvironmentFile body, type: str, returned: always}
"""

import json

from ansible.module_utils.basic import AnsibleModule
from ansible_collections.gptoss.host.plugins.module_utils.nccl_policy import policy_file


def main() -> None:
    module = AnsibleModule(
        argument_spec=dict(
            policy=dict(type="str", required=True),
            nvml_report=dict(type="str", default=""),
            ib_disable=dict(type="bool", default=True),
            torch_async_error_handling=dict(type="str", default="1"),
            extra=dict(type="dict", default={}),
        ),
        supports_check_mode=True,
    )
    params = module.params
    try:
        report = json.loads(params["nvml_report"]) if params["nvml_report"].strip() else None
    except ValueError as exc:
        module.fail_json(msg=f"nccl_policy: the NVML report is not JSON ({exc})")
    try:
        result = policy_file(params["policy"], report, params["ib_disable"],
                             params["torch_async_error_handling"], params["extra"])
    except ValueError as exc:
        module.fail_json(msg=str(exc))
    module.exit_json(changed=False, **result)


if __name__ == "__main__":
    main()
