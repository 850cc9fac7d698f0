#!/usr/bin/python
"""Ansible module: the CPU frequency governor on every CPU, set and read back."""

from __future__ import annotations

DOCUMENTATION = r"""
---
module: cpu_governor
short_description: Set the CPU frequency governor on every CPU and read it back
description:
  - Writes I(governor) to every CPU's C(scaling_governor) that differs (and, for C(performance),
    the energy-performance preference where the driver offers one), then reads every CPU back.
  - Refuses, writing nothing, a governor the cpufreq driver does not offer.
  - A machine without cpufreq (a VM, a container) is reported as not supported, not as a failure.
  - The rule is C(module_utils/cpu_governor.py), shared with the boot unit and verify (CPU-001).
  - Check mode reports the CPUs it would set; diff shows each CPU's governor before and after.
options:
  governor: {description: The governor to set., type: str, required: true}
author: gptoss-host
"""

EXAMPLES = r"""
- name: Performance governor on every CPU
  gptoss.host.cpu_governor:
    governor: performance
  register: __cpu_governor_run
"""

RETURN = r"""
supported: {description: Whether the machine has cpufreq., type: bool, returned: always}
reason: {description: Why not supported., type: str, returned: when not supported}
driver: {description: The cpufreq driver., type: str, returned: when supported}
set: {description: The CPUs whose governor was (or would be) written., type: list, returned: always}
cpus: {description: CPU -> governor, available governors, EPP (after the change)., type: dict, returned: always}
"""

from ansible.module_utils.basic import AnsibleModule
from ansible_collections.gptoss.host.plugins.module_utils import cpu_governor


def governors_text(cpus: dict) -> str:
    return "".join(f"{cpu} {info['governor']}\n" for cpu, info in cpus.items())


def main() -> None:
    module = AnsibleModule(argument_spec=dict(governor=dict(type="str", required=True)),
                           supports_check_mode=True)
    governor = module.params["governor"]
    before = cpu_governor.state()
    try:
        result = cpu_governor.apply(governor, check=module.check_mode)
    except (cpu_governor.GovernorError, OSError) as exc:
        module.fail_json(msg=f"cpu_governor: {exc}")
    if module._diff and result["changed"]:
        after = {cpu: {**info, "governor": governor} for cpu, info in before["cpus"].items()} \
            if module.check_mode else result["cpus"]
        result["diff"] = {"before": governors_text(before["cpus"]), "after": governors_text(after),
                          "before_header": "scaling_governor", "after_header": "scaling_governor"}
    module.exit_json(**result)


if __name__ == "__main__":
    main()
