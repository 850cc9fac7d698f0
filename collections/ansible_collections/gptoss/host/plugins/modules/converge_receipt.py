#!/usr/bin/python
"""Ansible module: does the converge receipt vouch for this run (check), or write it (write)."""

from __future__ import annotations

DOCUMENTATION = r"""
---
module: converge_receipt
short_description: The receipt of the last full converge - check it against this run, or write it
description:
  - See C(module_utils/converge_receipt.py) for what the receipt holds and why.
  - I(state=check) reads the live state the roles manage and compares it, and the inputs digest,
    with the receipt; C(current) says whether the run can end here for this host, C(differs) says
    which parts changed. Read-only.
  - I(state=write) writes the receipt (atomically, root-only) after a full converge succeeded; in
    check mode it only reports. I(state=absent) removes it, so the next run is a full converge.
  - The action plugin of the same name computes I(inputs) on the controller.
options:
  state: {description: What to do., type: str, choices: [check, write, absent], default: check}
  inputs: {description: The controller's digest of this run's inputs., type: str, default: ""}
  input_problems:
    description: Why the inputs could not be computed ahead (the action plugin); any makes the run a full converge.
    type: list
    elements: str
    default: []
  max_age_s:
    description: A receipt older than this many seconds vouches for nothing (0 - no limit).
    type: int
    default: 86400
  path: {description: The receipt file., type: path, default: /var/lib/gptoss/converge-receipt.json}
  watch:
    description: Paths whose files are watched (walked; the verify records add the paths they name).
    type: list
    elements: path
    default: []
  skip: {description: Name patterns left out of the walk (service data)., type: list, elements: str, default: []}
  records_dir:
    description: The verify records whose absolute paths are watched too.
    type: path
    default: /etc/gptoss/verify.d
  units: {description: Unit name patterns whose state is watched., type: list, elements: str, default: []}
  notices:
    description: Messages the converge printed that still hold (a run the receipt ends shows them again).
    type: list
    elements: str
    default: []
  sources:
    description: Controller only (the action plugin) - the project's files and folders whose content is an input.
    type: list
    elements: path
  var_prefixes:
    description: Controller only - variables with these prefixes (every inventory host's) are inputs.
    type: list
    elements: str
  facts: {description: Controller only - the facts the roles read., type: list, elements: str}
  controller_files:
    description: Controller only - files and folders the roles copy from the controller.
    type: list
    elements: path
author: gptoss-host
"""

EXAMPLES = r"""
- name: Does the last converge's receipt vouch for this run
  gptoss.host.converge_receipt:
    watch: [/etc/gptoss, /opt/gptoss]
    units: ["gptoss-*"]
    sources: ["{{ playbook_dir }}/roles", "{{ playbook_dir }}/templates"]
    var_prefixes: [vllm_service_, model_weights_]
    facts: [distribution, distribution_release, kernel]
  register: __receipt
"""

RETURN = r"""
current: {description: The receipt vouches for this run (state check)., type: bool, returned: always}
differs: {description: Why not - the parts that differ., type: list, returned: always}
notices: {description: The receipt's notices (state check, when current)., type: list, returned: always}
written_at: {description: When the receipt was written., type: str, returned: when a receipt exists}
"""

import datetime
import fnmatch
import json
import os

from ansible.module_utils.basic import AnsibleModule
from ansible_collections.gptoss.host.plugins.module_utils import atomic_file, converge_receipt


def unit_state(module: AnsibleModule, patterns: list[str]) -> str:
    """`systemctl show` of the units (files or loaded) matching the patterns, as text."""
    if not patterns:
        return ""
    found: set[str] = set()
    for listing in (["list-unit-files"], ["list-units", "--all"]):
        rc, out, err = module.run_command(["systemctl", *listing, "--no-legend", "--no-pager", "--plain", *patterns],
                                          environ_update={"LC_ALL": "C"})
        # list-unit-files exits 1 when no file matches; anything else is systemd not answering.
        if rc not in (0, 1):
            module.fail_json(msg=f"converge_receipt: systemctl {listing[0]} failed: {err.strip()}")
        found |= {line.split()[0] for line in out.splitlines() if line.strip()}
    names = sorted(n for n in found if any(fnmatch.fnmatchcase(n, p) for p in patterns))
    if not names:
        return "no units"
    rc, out, err = module.run_command(["systemctl", "show", "--property", ",".join(converge_receipt.UNIT_PROPERTIES),
                                       "--", *names], environ_update={"LC_ALL": "C"})
    if rc != 0:
        module.fail_json(msg=f"converge_receipt: systemctl show failed: {err.strip()}")
    return out


def read_receipt(path: str) -> dict | None:
    try:
        with open(path, encoding="utf-8") as handle:
            receipt = json.load(handle)
    except FileNotFoundError:
        return None
    except (OSError, ValueError):
        return {"format": "unreadable"}
    return receipt if isinstance(receipt, dict) else {"format": "unreadable"}


def main() -> None:
    module = AnsibleModule(
        argument_spec=dict(
            state=dict(type="str", choices=["check", "write", "absent"], default="check"),
            inputs=dict(type="str", default=""),
            input_problems=dict(type="list", elements="str", default=[]),
            max_age_s=dict(type="int", default=86400),
            path=dict(type="path", default="/var/lib/gptoss/converge-receipt.json"),
            watch=dict(type="list", elements="path", default=[]),
            skip=dict(type="list", elements="str", default=[]),
            records_dir=dict(type="path", default="/etc/gptoss/verify.d"),
            units=dict(type="list", elements="str", default=[]),
            notices=dict(type="list", elements="str", default=[]),
        ),
        supports_check_mode=True,
    )
    p = module.params
    receipt = read_receipt(p["path"])
    if p["state"] == "absent":
        changed = os.path.lexists(p["path"])
        if changed and not module.check_mode:
            os.unlink(p["path"])
        module.exit_json(changed=changed, current=False, differs=[], notices=[])
    if p["state"] in ("check", "write") and not p["inputs"]:
        module.fail_json(msg="converge_receipt: inputs is empty (the action plugin computes it on the controller)")
    # The receipt may live under a watched folder: it is not state it vouches for. Its folder is made
    # before the state is read, or the first receipt would vouch for a host without it.
    skip = [*p["skip"], os.path.basename(p["path"]), "." + os.path.basename(p["path"]) + ".*"]
    if p["state"] == "write" and not module.check_mode:
        os.makedirs(os.path.dirname(p["path"]), mode=0o755, exist_ok=True)
    state = converge_receipt.state_digests(p["watch"], p["records_dir"], unit_state(module, p["units"]), skip)
    differs = converge_receipt.differing_parts(receipt, p["inputs"], state, p["input_problems"], p["max_age_s"])
    if p["state"] == "check":
        module.exit_json(changed=False, current=not differs, differs=differs,
                         notices=(receipt or {}).get("notices", []) if not differs else [],
                         written_at=(receipt or {}).get("written_at", ""))
    written_at = datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds")
    text = converge_receipt.receipt_text(p["inputs"], state, p["notices"], written_at)
    old = (receipt or {})
    # Written again whenever anything differs, its time included: a receipt is as old as the last
    # full converge that vouched for the host.
    changed = bool(differs) or old.get("notices", []) != p["notices"] or old.get("inputs") != p["inputs"]
    if changed and not module.check_mode:
        atomic_file.write_atomically(p["path"], text, 0o600)
    module.exit_json(changed=changed, current=True, differs=differs, notices=p["notices"], written_at=written_at)


if __name__ == "__main__":
    main()
