#!/usr/bin/python
"""Ansible module: which of some Debian packages are not installed, from dpkg's database alone."""

from __future__ import annotations

DOCUMENTATION = r"""
---
module: deb_missing
short_description: Name the Debian packages of a list that are not installed (read-only, fast)
description:
  - Asks C(dpkg-query) for the status of I(names) and returns those not in state C(installed).
  - Reads dpkg's database only; it does not load apt's cache and never refreshes package lists,
    so a role can skip its C(ansible.builtin.apt) task (which loads the cache, ~1-2 s, and may
    refresh the lists) when nothing is missing.
  - A name with a version or release (C(pkg=1.0), C(pkg/bookworm)) or a wildcard is always returned
    as missing, so that apt decides about it. An architecture suffix (C(pkg:amd64)) is ignored.
  - Changes nothing; supports check mode.
options:
  names: {description: Package names., type: list, elements: str, required: true}
author: gptoss-host
"""

EXAMPLES = r"""
- name: Packages the venv needs that are not installed yet
  gptoss.host.deb_missing:
    names: [python3-venv, python3-packaging]
  register: __role_missing_debs

- name: Install them
  ansible.builtin.apt:
    name: "{{ __role_missing_debs.missing }}"
    state: present
    update_cache: true
    cache_valid_time: 86400
  when: __role_missing_debs.missing | length > 0
"""

RETURN = r"""
missing: {description: The names of I(names) that are not installed, in their order., type: list, returned: always}
"""

import re

from ansible.module_utils.basic import AnsibleModule

# Anything apt would read as more than a plain package name.
_NOT_A_PLAIN_NAME = re.compile(r"[=/*?\[\]]")


def _plain(name: str) -> str:
    return name.split(":", 1)[0]


def missing_packages(module: AnsibleModule, names: list[str]) -> list[str]:
    plain = sorted({_plain(name) for name in names if not _NOT_A_PLAIN_NAME.search(name)})
    installed: set[str] = set()
    if plain:
        # rc 1 only says some name is unknown to dpkg: such a name is simply not "installed".
        rc, out, err = module.run_command(["dpkg-query", "-W", "-f", "${Package}\t${db:Status-Status}\n", "--",
                                           *plain], environ_update={"LC_ALL": "C"})
        if rc not in (0, 1):
            module.fail_json(msg=f"dpkg-query failed (rc {rc}): {err.strip()}")
        installed = {package for package, _, status in (line.partition("\t") for line in out.splitlines())
                     if status == "installed"}
    return [name for name in names if _NOT_A_PLAIN_NAME.search(name) or _plain(name) not in installed]


def main() -> None:
    module = AnsibleModule(argument_spec=dict(names=dict(type="list", elements="str", required=True)),
                           supports_check_mode=True)
    module.exit_json(changed=False, missing=missing_packages(module, module.params["names"]))


if __name__ == "__main__":
    main()
