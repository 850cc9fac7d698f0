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
  - A unit whose unit file comes from a package (C(nginx.service)) is named with I(installed_stamp). Its
    unit file is never removed; the unit is stopped and disabled only when the stamp says this
    configuration installed it and nothing matched by I(in_use) (another site of the same server)
    needs it; otherwise it keeps running and is reloaded (C(try-reload-or-restart)) after its I(files)
    are gone, so that it lets them go. The stamp stays (the package stays installed, and a role switched
    on again finds that it installed it).
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
  installed_stamp:
    description:
      - For I(units) whose unit files belong to a package; the file a role wrote when it installed that
        package. Present, the units are stopped and disabled (unless in use); absent, they are only reloaded.
    type: path
  in_use:
    description:
      - Globs of other configuration that uses the same units (C(/etc/nginx/sites-enabled/*)); a match
        that is not one of I(files) and, with I(in_use_pattern), whose content matches it, keeps the
        units running. Only with I(installed_stamp).
    type: list
    elements: str
    default: []
  in_use_pattern:
    description: A regular expression a match of I(in_use) must contain to count (an nginx C(server) block).
    type: str
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

- name: Retire the proxy site; nginx stops only where the role installed it and no other site is served
  gptoss.host.retire_units:
    units: [nginx.service]
    installed_stamp: /var/lib/gptoss/reverse_proxy-nginx.json
    in_use: [/etc/nginx/sites-enabled/*, /etc/nginx/conf.d/*.conf]
    in_use_pattern: '(?m)^\s*server\s*\{'
    files: [/etc/nginx/sites-enabled/gptoss-proxy.conf, /etc/nginx/sites-available/gptoss-proxy.conf]
"""

RETURN = r"""
retired: {description: The units retired (or that would be, in check mode)., type: list, returned: always}
removed: {description: The paths removed (or that would be), the unit files last., type: list, returned: always}
stopped: {description: The units stopped and disabled (or that would be)., type: list, returned: always}
kept:
  description: >-
    Units of I(installed_stamp) whose files went but which were left as they are (reloaded where
    running), with the reason.
  type: dict
  returned: always
"""

import fnmatch
import glob
import os
import re
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


def users_of(params: dict, own: list[str]) -> list[str]:
    """The other configuration (matches of in_use, not among our files) that still needs the units."""
    pattern = re.compile(params["in_use_pattern"]) if params["in_use_pattern"] else None
    users = []
    for path in sorted({match for spec in params["in_use"] for match in glob.glob(spec)}):
        if path in own or not os.path.isfile(path):  # a dangling link serves nothing
            continue
        if pattern is not None:
            try:
                with open(path, encoding="utf-8", errors="replace") as handle:
                    if not pattern.search(handle.read()):
                        continue
            except OSError:
                continue
        users.append(path)
    return users


def running_or_enabled(module: AnsibleModule, unit: str) -> bool:
    """One systemctl call: is the unit active (or activating), or enabled at boot."""
    _, out, _ = module.run_command(["systemctl", "show", "-p", "ActiveState", "-p", "UnitFileState", "--", unit])
    state = dict(line.partition("=")[::2] for line in out.splitlines())
    return (state.get("ActiveState", "inactive") not in ("inactive", "failed", "")
            or state.get("UnitFileState", "") in ("enabled", "enabled-runtime", "linked", "alias"))


def package_unit_plan(module: AnsibleModule, unit: str, params: dict) -> tuple[list[str], bool, str]:
    """For a unit of installed_stamp: (our files left, stop it, why it is kept)."""
    own = [path.replace("{instance}", instance_of(unit)) for path in params["files"]]
    paths = [path for path in own if os.path.lexists(path)]
    if not os.path.exists(params["installed_stamp"]):
        return paths, False, f"not installed by this configuration (no {params['installed_stamp']})"
    users = users_of(params, own)
    if users:
        return paths, False, "still in use by " + ", ".join(users)
    return paths, running_or_enabled(module, unit), ""


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


def retire(module: AnsibleModule, unit: str, paths: list[str], stop: bool, reload: bool) -> None:
    if stop:
        systemctl(module, "stop", unit)
        systemctl(module, "disable", unit)
        systemctl(module, "reset-failed", unit, must_work=False)  # not failed: nothing to reset
    for path in paths:  # the unit file is last
        remove(path)
    if reload:  # a package's unit that stays: it lets our files go (nothing happens if it is not running)
        systemctl(module, "try-reload-or-restart", unit)


def main() -> None:
    module = AnsibleModule(
        argument_spec=dict(
            units=dict(type="list", elements="str", default=[]),
            pattern=dict(type="str"),
            keep=dict(type="list", elements="str", default=[]),
            files=dict(type="list", elements="str", default=[]),
            unit_dir=dict(type="path", default="/etc/systemd/system"),
            installed_stamp=dict(type="path"),
            in_use=dict(type="list", elements="str", default=[]),
            in_use_pattern=dict(type="str"),
        ),
        supports_check_mode=True,
    )
    params = module.params
    if (params["in_use"] or params["in_use_pattern"]) and not params["installed_stamp"]:
        module.fail_json(msg="in_use and in_use_pattern go with installed_stamp (a unit of a package)")
    package = bool(params["installed_stamp"])
    plan: dict[str, list[str]] = {}
    stopped: list[str] = []
    kept: dict[str, str] = {}
    claimed: set[str] = set()
    for unit in units_to_retire(params):
        if package:
            paths, stop, why = package_unit_plan(module, unit, params)
        else:
            paths = leftovers(unit, params["files"], params["unit_dir"])
            stop = os.path.join(params["unit_dir"], unit) in paths
            why = ""
        # A path without {instance} is shared by the units named together: the first one takes it.
        paths = [path for path in paths if path not in claimed]
        if paths or stop:
            plan[unit] = paths
            claimed.update(paths)
            if stop:
                stopped.append(unit)
            if why:
                kept[unit] = why
    removed = [path for paths in plan.values() for path in paths]
    result: dict = {"changed": bool(plan), "retired": list(plan), "removed": removed, "stopped": stopped,
                    "kept": kept}
    if module._diff and plan:
        header = "retired units and their files"
        before = "".join(f"{path}\n" for path in removed)
        if package:
            before += "".join(f"{unit}: running and enabled\n" for unit in stopped)
        result["diff"] = {"before": before, "after": "".join(
                              f"{unit}: left as it is, {why}; reloaded where it runs\n" for unit, why in kept.items()),
                          "before_header": header, "after_header": header}
    if plan and not module.check_mode:
        for unit, paths in plan.items():
            retire(module, unit, paths, unit in stopped, package and unit in kept and bool(paths))
        if not package:
            systemctl(module, "daemon-reload")
    module.exit_json(**result)


if __name__ == "__main__":
    main()
