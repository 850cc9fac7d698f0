#!/usr/bin/python
"""Ansible module: the files of one concern, each written whole, in one module run."""

from __future__ import annotations

DOCUMENTATION = r"""
---
module: managed_files
short_description: Several small root-owned files whose content the controller holds, in one module run
description:
  - One module run for all of them, because C(ansible.builtin.copy) and C(template) cost two module runs
    per file even when nothing changes (a C(stat), then a C(file) for the attributes), and each run on the
    host starts Python and compiles Ansible's module_utils from the module's zip again. The monitoring
    role's five console pages were ten module runs on every converge (docs/measurements.md, session 16).
  - Every file is root:root with the one mode given. A file whose content, mode or owner differs is written to a
    temporary file in its folder (mode and owner set before a byte is written), fsynced and renamed over
    it (module_utils.atomic_file), so a reader sees the old file or the new one.
  - Every folder must exist before anything is written; a missing one fails the task naming it, with no
    file of the list written, unless I(folder_mode) is given, which makes missing folders with that
    mode. Check mode and diff report what would change, per file.
options:
  files: {description: "Absolute path -> content (text, written as UTF-8).", type: dict, required: true}
  mode: {description: The mode of every file (octal)., type: str, default: "0644"}
  folder_mode:
    description: Make missing folders, root:root with this mode (octal); without it a missing folder fails.
    type: str
author: gptoss-host
"""

EXAMPLES = r"""
- name: Prometheus's console pages
  gptoss.host.managed_files:
    files:
      /etc/prometheus/consoles/gptoss.html: "{{ lookup('ansible.builtin.file', 'consoles/gptoss.html', rstrip=false) }}"
"""

RETURN = r"""
changed_paths:
  description: The files written (or that check mode would write), sorted.
  type: list
  returned: always
"""

import os

from ansible.module_utils.basic import AnsibleModule
from ansible_collections.gptoss.host.plugins.module_utils import atomic_file

ROOT_OWNER = (0, 0)
DEFAULT_MODE = "0644"


class FileSpecError(ValueError):
    pass


def octal_mode(text: str) -> int:
    try:
        mode = int(str(text), 8)
    except ValueError:
        raise FileSpecError(f"mode {text!r} is not octal") from None
    if not 0 <= mode <= 0o7777:
        raise FileSpecError(f"mode {text!r} is out of range")
    return mode


def wanted_files(files: dict, mode_text: str) -> list[tuple[str, bytes, int]]:
    """(path, content, mode) per file, sorted by path, or FileSpecError naming what is wrong."""
    mode = octal_mode(mode_text)
    wanted = []
    for path, content in sorted(files.items()):
        if not os.path.isabs(path) or os.path.normpath(path) != path:
            raise FileSpecError(f"{path!r} is not an absolute, normalised path")
        if content is None:
            raise FileSpecError(f"{path} has no content")
        wanted.append((path, str(content).encode("utf-8"), mode))
    return wanted


def current(path: str) -> tuple[bytes | None, tuple[int, int, int] | None]:
    """The file's bytes and (mode, uid, gid), or (None, None) where there is none."""
    try:
        stat = os.stat(path)
        with open(path, "rb") as handle:
            return handle.read(), (stat.st_mode & 0o7777, stat.st_uid, stat.st_gid)
    except FileNotFoundError:
        return None, None


def make_folders(folders: list[str], mode: int) -> None:
    """Each missing folder and its missing parents, root:root with `mode` (not the umask's)."""
    for folder in folders:
        missing = []
        while not os.path.isdir(folder):
            missing.append(folder)
            folder = os.path.dirname(folder)
        for path in reversed(missing):
            os.mkdir(path, mode)
            os.chmod(path, mode)
            os.chown(path, *ROOT_OWNER)


def as_text(data: bytes | None) -> str:
    return "" if data is None else data.decode("utf-8", errors="replace")


def main() -> None:
    module = AnsibleModule(argument_spec={"files": {"type": "dict", "required": True},
                                          "mode": {"type": "str", "default": DEFAULT_MODE},
                                          "folder_mode": {"type": "str"}},
                           supports_check_mode=True)
    try:
        wanted = wanted_files(module.params["files"], module.params["mode"])
        folder_mode = None if module.params["folder_mode"] is None else octal_mode(module.params["folder_mode"])
    except FileSpecError as err:
        module.fail_json(msg=f"managed_files: nothing written: {err}")
    missing = sorted({os.path.dirname(path) for path, _, _ in wanted if not os.path.isdir(os.path.dirname(path))})
    if missing and folder_mode is None and not module.check_mode:
        module.fail_json(msg=f"managed_files: nothing written: no folder {', '.join(missing)}")
    to_write, diffs = [], []
    for path, content, mode in wanted:
        old_content, old_attrs = current(path)
        if old_content == content and old_attrs == (mode, *ROOT_OWNER):
            continue
        to_write.append((path, content, mode))
        attrs = "" if old_attrs in (None, (mode, *ROOT_OWNER)) else (
            f" (mode/uid/gid {oct(old_attrs[0])}/{old_attrs[1]}/{old_attrs[2]} -> {oct(mode)}/0/0)")
        diffs.append({"before_header": path + attrs, "after_header": path,
                      "before": as_text(old_content), "after": as_text(content)})
    if not module.check_mode:
        if missing:
            make_folders(missing, folder_mode)
        for path, content, mode in to_write:
            atomic_file.write_atomically(path, content, mode, owner_root=True)
    result = {"changed": bool(to_write), "changed_paths": [path for path, _, _ in to_write]}
    if module._diff and diffs:
        result["diff"] = diffs
    module.exit_json(**result)


if __name__ == "__main__":
    main()
