#!/usr/bin/python
"""Ansible module: a root-only EnvironmentFile= of secrets, written whole or not at all."""

from __future__ import annotations

DOCUMENTATION = r"""
---
module: env_file
short_description: Write a 0600 root-only file of NAME='value' secrets that a systemd unit reads
description:
  - Every value must pass through systemd's EnvironmentFile= parser unchanged (the rule of
    module_utils.unit_inputs, shared with vLLM's API key file); a refused value fails the task
    before anything is written, naming the variable, never the value.
  - The file is written to a temporary file in the same folder with mode 0600 and renamed over the
    old one, so a reader never sees half a file or a moment of wider permissions.
  - The diff names the variables that change, never their values.
options:
  path: {description: The file., type: path, required: true}
  values: {description: "Variable name to secret value.", type: dict, required: true, no_log: true}
author: gptoss-host
"""

EXAMPLES = r"""
- name: Open WebUI's secrets
  gptoss.host.env_file:
    path: /etc/gptoss/webui-secrets.env
    values:
      WEBUI_SECRET_KEY: "{{ webui_secret_key }}"
"""

RETURN = r"""
changed_names: {description: Variables added, removed or changed, type: list, returned: always}
"""

import os

from ansible.module_utils.basic import AnsibleModule
from ansible_collections.gptoss.host.plugins.module_utils import atomic_file, unit_inputs

MODE = 0o600


def changed_names(old: dict[str, str], new: dict[str, str]) -> list[str]:
    return sorted(name for name in set(old) | set(new) if old.get(name) != new.get(name))


def main() -> None:
    module = AnsibleModule(
        argument_spec={"path": {"type": "path", "required": True},
                       "values": {"type": "dict", "required": True, "no_log": True}},
        supports_check_mode=True,
    )
    path = module.params["path"]
    values = {str(k): str(v) for k, v in module.params["values"].items()}
    try:
        text = unit_inputs.env_file_text(values)
    except ValueError as err:
        module.fail_json(msg=f"{path}: nothing written: {err}")
    old_values: dict[str, str] = {}
    old_text, old_mode = None, None
    if os.path.exists(path):
        stat = os.stat(path)
        old_mode = (stat.st_mode & 0o7777, stat.st_uid, stat.st_gid)
        with open(path, encoding="ascii", errors="replace") as handle:
            old_text = handle.read()
        try:
            old_values = unit_inputs.parse_env_file(old_text)
        except unit_inputs.KeyFileError:
            old_values = {}
    names = changed_names(old_values, values)
    changed = old_text != text or old_mode != (MODE, 0, 0)
    result = {"changed": changed, "changed_names": names}
    if module._diff and changed:
        result["diff"] = {"before_header": path, "after_header": path,
                          "before": "".join(f"{n}=<secret>\n" for n in sorted(old_values)),
                          "after": "".join(f"{n}=<secret{' changed' if n in names else ''}>\n" for n in sorted(values))}
    if changed and not module.check_mode:
        atomic_file.write_atomically(path, text, MODE, owner_root=True)  # 0600 root before a byte is written
    module.exit_json(**result)


if __name__ == "__main__":
    main()
