#!/usr/bin/python
"""Ansible module: apt's candidate for some packages, from every configured source, against a required version."""

from __future__ import annotations

DOCUMENTATION = r"""
---
module: apt_candidate
short_description: Read apt's candidate versions and refuse when none reaches a required version
description:
  - Optionally refreshes apt's package lists (C(apt-get update); never in check mode), then reads
    C(apt-cache policy) for I(packages), that is the installed version, apt's candidate (pins and priorities
    applied) and every version each configured source offers.
  - Each package's candidate must carry a version at or above I(required) (Debian version rules;
    epochs and Debian revisions are ignored, so C(1:580.95.05-0ubuntu1) carries 580.95.05).
  - With I(fail_below=true) a shortfall fails the task with a message that names each candidate,
    its source, the requirement, every I(managed_urls) repository apt could not read, and I(fix).
  - Installs nothing and writes no configuration; only the package lists are refreshed, and that
    is never reported as a change.
options:
  packages: {description: Packages whose candidate must reach I(required)., type: list, elements: str, required: true}
  required: {description: "Minimum upstream version, e.g. C(580.65.06).", type: str, required: true}
  refresh: {description: Run C(apt-get update) first (skipped in check mode)., type: bool, default: false}
  private_lists:
    description:
      - Read every configured source afresh into a private temporary folder (C(apt-get update) and
        C(apt-cache) with C(Dir::State::Lists) and C(Dir::Cache) there), removed afterwards. The host's
        own package lists and caches stay untouched, so this also runs in check mode (C(invoke preflight)).
    type: bool
    default: false
  managed_urls:
    description: Repository URLs this play configured; each one apt has no package list for is named.
    type: list
    elements: str
    default: []
  loaded_version:
    description: Version of the running counterpart (e.g. the loaded kernel module); compared with I(required).
    type: str
    default: ""
  fail_below: {description: Fail when a candidate is below I(required)., type: bool, default: true}
  label: {description: Prefix of the messages., type: str, default: apt_candidate}
  fix: {description: What to do about a refusal; appended to its message., type: str, default: ""}
author: gptoss-host
"""

EXAMPLES = r"""
- name: Read the driver candidate before installing anything
  gptoss.host.apt_candidate:
    packages: [nvidia-driver-cuda, nvidia-kernel-open-dkms]
    required: "580.65.06"
    refresh: true
    managed_urls: [https://developer.download.nvidia.com/compute/cuda/repos/debian12/x86_64/]
    fix: set nvidia_driver_source to nvidia
"""

RETURN = r"""
ok: {description: Every candidate reaches I(required)., type: bool, returned: always}
packages:
  description: Per package - installed, candidate, its sources, the best offer at or above I(required).
  type: list
  returned: always
unreadable_sources:
  description: I(managed_urls) apt has no package list for, with apt-get update's reason.
  type: list
  returned: always
refreshed: {description: Whether apt-get update ran., type: bool, returned: always}
installed_meets:
  description: The installed version of the first package reaches I(required).
  type: bool
  returned: always
loaded_meets: {description: I(loaded_version) reaches I(required)., type: bool, returned: always}
reboot_required: {description: Installed is fine but the loaded counterpart is not., type: bool, returned: always}
message: {description: The decision in words., type: str, returned: always}
"""

import os
import pwd
import shutil
import tempfile

from ansible.module_utils.basic import AnsibleModule
from ansible_collections.gptoss.host.plugins.module_utils.apt_policy import (
    decide,
    driver_status,
    parse_package_files,
    parse_policy,
    parse_update_failures,
)

C_LOCALE = {"LC_ALL": "C", "LANG": "C"}


def run_apt(module: AnsibleModule, argv: list[str]) -> str:
    code, out, err = module.run_command(argv, environ_update=C_LOCALE)
    if code != 0:
        module.fail_json(msg=f"apt_candidate: {' '.join(argv)} failed (rc={code}): {err.strip() or out.strip()}")
    return out + err


def private_apt_dirs() -> tuple[str, list[str]]:
    """A temporary lists + cache folder and the apt options that point there."""
    root = tempfile.mkdtemp(prefix="gptoss-apt.")
    os.chmod(root, 0o755)  # apt downloads as its sandbox user _apt, which must reach partial/
    for sub in ("lists/partial", "cache/archives/partial"):
        os.makedirs(os.path.join(root, sub))
    try:
        apt_user = pwd.getpwnam("_apt")
        os.chown(os.path.join(root, "lists", "partial"), apt_user.pw_uid, -1)
    except KeyError:
        pass
    return root, ["-o", f"Dir::State::Lists={root}/lists", "-o", f"Dir::Cache={root}/cache"]


def main() -> None:
    module = AnsibleModule(
        argument_spec=dict(
            packages=dict(type="list", elements="str", required=True),
            required=dict(type="str", required=True),
            refresh=dict(type="bool", default=False),
            managed_urls=dict(type="list", elements="str", default=[]),
            loaded_version=dict(type="str", default=""),
            fail_below=dict(type="bool", default=True),
            label=dict(type="str", default="apt_candidate"),
            fix=dict(type="str", default=""),
            private_lists=dict(type="bool", default=False),
        ),
        supports_check_mode=True,
    )
    params = module.params
    update_output = ""
    private_root, apt_opts = private_apt_dirs() if params["private_lists"] else ("", [])
    try:
        refreshed = bool(private_root) or (params["refresh"] and not module.check_mode)
        if refreshed:
            # apt-get update exits 0 when a source cannot be reached ("W: Failed to fetch") and 100 when
            # one cannot be trusted ("E: The repository ... is not signed"); either way the other sources
            # were read, and the problem lines name the source: the decision reports them, not a crash.
            _code, out, err = module.run_command(["apt-get", *apt_opts, "update"], environ_update=C_LOCALE)
            update_output = out + err
        policies = parse_policy(run_apt(module, ["apt-cache", *apt_opts, "policy", *params["packages"]]))
        package_files = parse_package_files(run_apt(module, ["apt-cache", *apt_opts, "policy"]))
    finally:
        if private_root:
            shutil.rmtree(private_root, ignore_errors=True)
    try:
        decision = decide(policies, params["packages"], params["required"], params["managed_urls"],
                          package_files, parse_update_failures(update_output), params["label"], params["fix"])
        first = decision.packages[0] if decision.packages else None
        status = driver_status(first.installed if first else None, params["loaded_version"] or None,
                               params["required"])
    except ValueError as exc:
        module.fail_json(msg=f"{params['label']}: {exc}")
    result = {"changed": False, "refreshed": refreshed, **decision.as_dict(), **status}
    if module.check_mode and params["refresh"] and not private_root and not decision.ok:
        result["message"] += "\n(check mode: the package lists were not refreshed)"
    if not decision.ok and params["fail_below"]:
        module.fail_json(msg=result.pop("message"), **result)
    module.exit_json(**result)


if __name__ == "__main__":
    main()
