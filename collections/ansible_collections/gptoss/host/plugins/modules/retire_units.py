#!/usr/bin/python
"""Ansible module: take systemd units this configuration no longer runs off a host, with their files."""

from __future__ import annotations

DOCUMENTATION = r"""
---
module: retire_units
short_description: Stop, disable and remove units that are no longer configured, and the files that belong to them
description:
  - The one way the roles take a service off a host (the router or the UI switched off, the single
    vLLM unit where instances serve instead, instance units a smaller replica profile does not run).
  - A unit is retired when its unit file is in I(unit_dir), or, for I(units), when any of its
    I(files) is still there (an install that failed before the unit was written).
  - For each such unit, in this order; stop, disable, reset a failed state (so nothing reports a
    dead server), remove its I(files) (folders with their contents), and remove the unit file last,
    so that a retire cut short is found and finished by the next run. One C(daemon-reload) follows.
  - A stop or disable that fails fails the task before anything of that unit is removed.
  - Where nothing is left, the module only looks (one call, nothing run); supports check mode and diff.
options:
  units: {description: Unit names to retire (C(gptoss-router.service))., type: list, elements: str, default: []}
  pattern:
    description:
      - A glob of unit names in I(unit_dir) (C(gptoss-vllm@*.service)); every match not in I(keep) is retired.
    type: str
  keep: {description: Unit names matched by I(pattern) that stay., type: list, elements: str, default: []}
  files:
    description:
      - Paths that go with each retired unit. C({instance}) is replaced by the unit's instance
        name (the part after C(@)), so a path can name one instance's files.
    type: list
    elements: str
    default: []
  unit_dir: {description: Where the unit files are., type: path, default: /etc/systemd/system}
author: gptoss-host
"""

EXAMPLES = r"""
- name: Retire the router where it is switched off
  gptoss.host.retire_units:
    units: [gptoss-router.service]
    files: [/etc/gptoss/router.json, /etc/gptoss/verify.d/router.json]

- name: Retire the instance units that this configuration does not run
  gptoss.host.retire_units:
    pattern: gptoss-vllm@*.service
    keep: [gptoss-vllm@0.service]
    files: ["/etc/gptoss/vllm-args@{instance}.json"]
"""

RETURN = r"""
retired: {description: The units retired (or that would be, in check mode)., type: list, returned: always}
removed: {description: The paths removed (or that would be), the unit files last., type: list, returned: always}
"""

import fnmatch
import os
import shutil

from ansible.module_utils.basic import AnsibleModule


def instance_of(unit: str) -> str:
    """'gptoss-vllm@a.service' -> 'a'; '' for a unit that is not an instance."""
    stem = unit.rsplit(".", 1)[0]
    return stem.partition("@")[2]


def leftovers(unit: str, files: list[str], unit_dir: str) -> list[str]:
    """What of this unit is still on the host: its files, then its unit file (the order of removal)."""
    paths = [path.replace("{instance}", instance_of(unit)) for path in files] + [os.path.join(unit_dir, unit)]
    return [path for path in paths if os.path.lexists(path)]


def units_to_retire(params: dict) -> list[str]:
    named = list(params["units"])
    if params["pattern"]:
        present = sorted(os.listdir(params["unit_dir"])) if os.path.isdir(params["unit_dir"]) else []
        named += [unit for unit in present
                  if fnmatch.fnmatchcase(unit, params["pattern"]) and unit not in params["keep"] and unit not in named]
    return named


def systemctl(module: AnsibleModule, *args: str, must_work: bool = True) -> None:
    rc, _, err = module.run_command(["systemctl", *args])
    if rc != 0 and must_work:
        module.fail_json(msg=f"systemctl {' '.join(args)} failed (rc {rc}): {err.strip()}; nothing of it was removed")


def remove(path: str) -> None:
    if os.path.isdir(path) and not os.path.islink(path):
        shutil.rmtree(path)
    elif os.path.lexists(path):
        os.unlink(path)


def retire(module: AnsibleModule, unit: str, paths: list[str], unit_dir: str) -> None:
    if os.path.join(unit_dir, unit) in paths:
        systemctl(module, "stop", unit)
        systemctl(module, "disable", unit)
        systemctl(module, "reset-failed", unit, must_work=False)  # not failed: nothing to reset
    for path in paths:  # the unit file is last
        remove(path)


def main() -> None:
    module = AnsibleModule(
        argument_spec=dict(
            units=dict(type="list", elements="str", default=[]),
            pattern=dict(type="str"),
            keep=dict(type="list", elements="str", default=[]),
            files=dict(type="list", elements="str", default=[]),
            unit_dir=dict(type="path", default="/etc/systemd/system"),
        ),
        supports_check_mode=True,
    )
    params = module.params
    plan: dict[str, list[str]] = {}
    claimed: set[str] = set()
    for unit in units_to_retire(params):
        # A path without {instance} is shared by the units named together: the first one takes it.
        paths = [path for path in leftovers(unit, params["files"], params["unit_dir"]) if path not in claimed]
        if paths:
            plan[unit] = paths
            claimed.update(paths)
    removed = [path for paths in plan.values() for path in paths]
    result: dict = {"changed": bool(plan), "retired": list(plan), "removed": removed}
    if module._diff and plan:
        header = "retired units and their files"
        result["diff"] = {"before": "".join(f"{path}\n" for path in removed), "after": "",
                          "before_header": header, "after_header": header}
    if plan and not module.check_mode:
        for unit, paths in plan.items():
            retire(module, unit, paths, params["unit_dir"])
        systemctl(module, "daemon-reload")
    module.exit_json(**result)


if __name__ == "__main__":
    main()
