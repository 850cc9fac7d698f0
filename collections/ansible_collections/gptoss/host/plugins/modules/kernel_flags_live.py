#!/usr/bin/python
"""Ansible module: which kernel/driver flags are not live yet (read-only), by the rule verify uses."""

from __future__ import annotations

DOCUMENTATION = r"""
---
module: kernel_flags_live
short_description: Name the kernel/driver flags that are not in effect yet (read-only)
description:
  - With I(method=grub), reads C(/proc/cmdline); with I(method=modprobe), reads the loaded NVIDIA
    driver's C(/proc/driver/nvidia/params).
  - Decides with C(module_utils/kernel_flags.py), the rule C(invoke verify) (KRN-001, KRN-002) and
    preflight also call, so the role's C(REBOOT REQUIRED) and its reboot agree with verify; in
    particular C(EnableGpuFirmware) is compared by its mode bits, not as text.
  - Changes nothing; supports check mode.
options:
  method: {description: Where the flags were put., type: str, choices: [grub, modprobe], required: true}
  flags: {description: The flags, C(key=value)., type: list, elements: str, required: true}
author: gptoss-host
"""

EXAMPLES = r"""
- name: Which flags are not live yet
  gptoss.host.kernel_flags_live:
    method: grub
    flags: [nvidia.NVreg_EnableGpuFirmware=0]
  register: __kernel_cmdline_live
"""

RETURN = r"""
pending: {description: The flags of I(flags) that are not in effect, in their order., type: list, returned: always}
reasons: {description: flag -> why it is not in effect., type: dict, returned: always}
read_from: {description: Where the live state was read., type: str, returned: always}
"""

from ansible.module_utils.basic import AnsibleModule
from ansible_collections.gptoss.host.plugins.module_utils import kernel_flags


def main() -> None:
    module = AnsibleModule(
        argument_spec=dict(
            method=dict(type="str", required=True, choices=list(kernel_flags.METHODS)),
            flags=dict(type="list", elements="str", required=True),
        ),
        supports_check_mode=True,
    )
    method, flags = module.params["method"], module.params["flags"]
    try:
        with open(kernel_flags.PROC_CMDLINE, encoding="utf-8", errors="replace") as handle:
            cmdline = handle.read()
        params = kernel_flags.read_driver_params() if method == "modprobe" else None
    except OSError as exc:
        module.fail_json(msg=f"kernel_flags_live: cannot read the live state: {exc}")
    reasons = kernel_flags.flag_problems(method, flags, cmdline, params)
    module.exit_json(changed=False, pending=[flag for flag in flags if flag in reasons], reasons=reasons,
                     read_from=kernel_flags.where_read(method, params))


if __name__ == "__main__":
    main()
