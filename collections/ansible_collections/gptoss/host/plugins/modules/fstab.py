#!/usr/bin/python
"""Ansible module: one fstab entry, validated before it replaces the old file, and remounted live."""

from __future__ import annotations

DOCUMENTATION = r"""
---
module: fstab
short_description: Manage one /etc/fstab entry safely and remount it live
description:
  - Ensures the entry for I(path) has the given source, type and options.
  - The new fstab is written to a temporary file next to the old one, checked with
    C(findmnt --verify --tab-file), backed up, then renamed over the old one.
    A bad device, UUID or existing malformed line fails the task and leaves fstab untouched.
  - C(nobarrier) is accepted for ext4 only; XFS rejects it since Linux 4.19 and the host would not boot.
  - With I(remount=true) the live mount is (re)mounted and read back from /proc/self/mountinfo.
options:
  path: {description: Mount point., type: path, required: true}
  src: {description: "Device path, or UUID=/LABEL=/PARTUUID= spec.", type: str, required: true}
  fstype: {description: File system type., type: str, required: true}
  opts: {description: Mount options., type: list, elements: str, default: [defaults]}
  dump: {description: Dump field., type: int, default: 0}
  passno: {description: fsck pass number., type: int, default: 2}
  fstab: {description: The fstab file., type: path, default: /etc/fstab}
  backup: {description: Keep a timestamped copy of the old fstab., type: bool, default: true}
  remount: {description: Mount or remount now so the live options match., type: bool, default: true}
author: gptoss-host
"""

EXAMPLES = r"""
- name: Model disk with noatime,nobarrier
  gptoss.host.fstab:
    path: /models
    src: UUID=0a1b...
    fstype: ext4
    opts: [defaults, noatime, nobarrier]
"""

RETURN = r"""
live_options: {description: Options of the live mount after the task, type: list, returned: when mounted}
backup_file: {description: Copy of the old fstab, type: str, returned: when changed and backup}
"""

import os

from ansible.module_utils.basic import AnsibleModule
from ansible_collections.gptoss.host.plugins.module_utils import atomic_file, mountinfo

# The spellings of "no write barrier": the same alias rule verify (MNT-001) applies.
BARRIER_OPTIONS = mountinfo.OPTION_ALIASES["nobarrier"]
FSTYPES_WITH_NOBARRIER = {"ext4"}


def escape_fstab(value: str) -> str:
    return value.replace("\\", "\\134").replace(" ", "\\040").replace("\t", "\\011")



def parse_fstab(text: str) -> list[tuple[str, list[str] | None]]:
    """Lines with their fields; comments and blanks keep fields=None. Malformed lines raise."""
    parsed = []
    for number, line in enumerate(text.splitlines(), start=1):
        stripped = line.strip()
        if not stripped or stripped.startswith("#"):
            parsed.append((line, None))
            continue
        fields = stripped.split()
        if len(fields) < 4 or len(fields) > 6 or not all(f.isdigit() for f in fields[4:]):
            raise ValueError(f"line {number} is malformed (want 4-6 fields: src path type opts [dump pass]): {line!r}")
        parsed.append((line, fields))
    return parsed



def resolve_source(module: AnsibleModule, src: str) -> str:
    """The block device behind `src`, or a clear failure (nothing has been written yet)."""
    if "=" in src.split("/")[0]:
        code, out, err = module.run_command(["findfs", src])
        if code != 0 or not out.strip():
            module.fail_json(msg=f"fstab: source {src} does not resolve to any device (findfs: {err.strip()}); "
                             "fstab left untouched")
        return out.strip()
    if not os.path.exists(src):
        module.fail_json(msg=f"fstab: device {src} does not exist; fstab left untouched")
    return src


def verify_tab_file(module: AnsibleModule, tab_file: str) -> None:
    code, out, err = module.run_command(["findmnt", "--verify", "--tab-file", tab_file])
    if code != 0:
        module.fail_json(msg=f"fstab: the new fstab fails `findmnt --verify`; fstab left untouched:\n{out}{err}")


def write_atomically(module: AnsibleModule, fstab: str, content: str) -> None:
    """The new fstab keeps the old one's mode and owner, passes `findmnt --verify` as the temporary
    file, replaces the old one and the folder is fsynced (module_utils/atomic_file)."""
    mode = owner = None
    if os.path.exists(fstab):
        stat = os.stat(fstab)
        mode, owner = stat.st_mode & 0o7777, (stat.st_uid, stat.st_gid)
    atomic_file.write_atomically(fstab, content, mode, owner=owner, sync_dir=True,
                                 check=lambda tmp: verify_tab_file(module, tmp))


def desired_line(params: dict) -> str:
    return " ".join([
        escape_fstab(params["src"]), escape_fstab(params["path"]), params["fstype"],
        ",".join(params["opts"]), str(params["dump"]), str(params["passno"]),
    ])


def new_fstab_text(old: str, params: dict) -> str:
    lines, replaced = [], False
    for line, fields in parse_fstab(old):
        if fields and mountinfo.unescape(fields[1]) == params["path"]:
            if not replaced:
                lines.append(desired_line(params))
                replaced = True
            continue  # a duplicate entry for the same mount point would shadow ours
        lines.append(line)
    if not replaced:
        lines.append(desired_line(params))
    return "\n".join(lines) + "\n"


def remount(module: AnsibleModule, params: dict, result: dict) -> None:
    mount = mountinfo.read_mount_at(params["path"])
    if mount is not None and not mountinfo.missing_options(params["opts"], mount):
        result["live_options"] = sorted(mountinfo.live_options(mount))
        return
    result["changed"] = True
    if module.check_mode:
        result["live_options"] = sorted(mountinfo.live_options(mount)) if mount is not None else None
        return
    os.makedirs(params["path"], exist_ok=True)
    cmd = ["mount", "-o", "remount," + ",".join(params["opts"]), params["path"]] if mount is not None \
        else ["mount", params["path"]]
    code, out, err = module.run_command(cmd)
    if code != 0:
        module.fail_json(msg=f"fstab: {' '.join(cmd)} failed: {err.strip() or out.strip()}", **result)
    mount = mountinfo.read_mount_at(params["path"])
    missing = params["opts"] if mount is None else mountinfo.missing_options(params["opts"], mount)
    if missing:
        module.fail_json(msg=f"fstab: {params['path']} is mounted without {missing} after remount", **result)
    result["live_options"] = sorted(mountinfo.live_options(mount))


def main() -> None:
    module = AnsibleModule(
        argument_spec=dict(
            path=dict(type="path", required=True),
            src=dict(type="str", required=True),
            fstype=dict(type="str", required=True),
            opts=dict(type="list", elements="str", default=["defaults"]),
            dump=dict(type="int", default=0),
            passno=dict(type="int", default=2),
            fstab=dict(type="path", default="/etc/fstab"),
            backup=dict(type="bool", default=True),
            remount=dict(type="bool", default=True),
        ),
        supports_check_mode=True,
    )
    params = module.params
    if BARRIER_OPTIONS & set(params["opts"]) and params["fstype"] not in FSTYPES_WITH_NOBARRIER:
        module.fail_json(msg=f"fstab: refusing nobarrier on {params['fstype']} for {params['path']}: only ext4 "
                             "accepts it (XFS rejects it since Linux 4.19 and the host would fail to boot); "
                             "fstab left untouched")
    resolve_source(module, params["src"])
    old = ""
    if os.path.exists(params["fstab"]):
        with open(params["fstab"]) as handle:
            old = handle.read()
    try:
        new = new_fstab_text(old, params)
    except ValueError as exc:
        module.fail_json(msg=f"fstab: {params['fstab']} {exc}; fstab left untouched")
    result: dict = {"changed": old != new}
    if module._diff:
        result["diff"] = {"before": old, "after": new, "before_header": params["fstab"],
                          "after_header": params["fstab"]}
    if result["changed"] and not module.check_mode:
        if params["backup"] and old:
            result["backup_file"] = module.backup_local(params["fstab"])
        write_atomically(module, params["fstab"], new)
    if params["remount"]:
        remount(module, params, result)
    module.exit_json(**result)


if __name__ == "__main__":
    main()
