"""The converge receipt's inputs, computed on the controller: the values the roles will use.

A variable's raw text says nothing about its value: `vllm_service_api_key: "{{ vault_gptoss_api_key }}"`
stays the same text when the vault's key is rotated, and so does a `lookup('file', ...)` whose file
changed or a value templated from an `-e` variable. So every variable a role reads (every
`<role>_*`, `gptoss_*`, `vllm_*` name and the connection variables, of every inventory host) is
*templated* here with Ansible's own templating, as the roles will see it: vault-decrypted, lookups
resolved, extra vars applied. The digest of those values (never a value itself) is the receipt's
input, with the content of the inventory and vault files and the extra vars.

A value that cannot be computed ahead safely makes the run a full converge, and says why:
- a lookup that may have side effects or answer differently per call (`pipe`, `password`, `url`,
  anything not in SAFE_LOOKUPS), anywhere in the variables (a role variable may reach it through
  others), is never run here;
- a value the user set that does not template (an undefined variable, a failing filter).
A role default the user did not override and that names a variable only a task sets (`__role_*`)
is digested by its text: the text is in the project's files, which are an input already.

Controller only (Ansible's templating): plugin_utils is never shipped to a host.
"""

from __future__ import annotations

import hashlib
import os
import re
from collections.abc import Callable, Iterable, Mapping
from typing import Any

# Lookups that only read (files, environment, variables) and answer the same for the same input.
SAFE_LOOKUPS = frozenset({
    "file", "env", "vars", "first_found", "fileglob", "ini", "csvfile", "unvault", "template", "list",
    "items", "dict", "indexed_items", "nested", "together", "subelements", "sequence", "varnames", "config",
})
# The project's own lookups (plugins/lookup) read the project's files only: safe by the same rule.
OWN_LOOKUPS = "gptoss.host."
# lookup('name', ...), query("name", ...), q('name'); a name that is not a quoted literal is computed.
LOOKUP_CALL = re.compile(r"""\b(?:lookup|query|q)\s*\(\s*(?:(['"])([A-Za-z0-9_.]+)\1)?""")
# The receipt's own switches are how a run is asked, not what it converges.
RECEIPT_CONTROLS = ("gptoss_base_receipt",)
# Keys of a host's variables that are Ansible's, not the user's: never scanned for lookups.
MAGIC_KEYS = frozenset({"hostvars", "vars", "groups", "group_names", "ansible_facts", "omit", "environment",
                        "play_hosts", "ansible_play_hosts", "ansible_play_batch", "ansible_play_hosts_all",
                        "role_names", "ansible_role_names", "ansible_dependent_role_names", "playbook_dir",
                        "inventory_dir", "inventory_file", "ansible_config_file", "ansible_playbook_python"})
# The connection variables are the user's (the router lists other hosts' servers by them).
CONNECTION_VARS = ("ansible_host", "ansible_port", "ansible_user")
# Inventory trees are read whole (vault files by their encrypted bytes); a walk stops here.
INVENTORY_WALK_MAX = 20000


def lookup_names(value: Any) -> list[str]:
    """The lookup plugins a value's templates call ('(computed)' for a name that is not a literal)."""
    if isinstance(value, str):
        return [(match.group(2) or "(computed)").removeprefix("ansible.builtin.")
                for match in LOOKUP_CALL.finditer(value)]
    if isinstance(value, Mapping):
        return [name for item in value.values() for name in lookup_names(item)]
    if isinstance(value, (list, tuple)):
        return [name for item in value for name in lookup_names(item)]
    return []


def unsafe_lookups(variables: Mapping[str, Any]) -> list[str]:
    """'<variable>: lookup <name>' for each lookup that must not run ahead of the roles."""
    found = []
    for name in sorted(variables):
        if name in MAGIC_KEYS or (name.startswith("ansible_") and name not in CONNECTION_VARS):
            continue
        found += [f"{name}: lookup '{lookup}'" for lookup in lookup_names(variables[name])
                  if lookup not in SAFE_LOOKUPS and not lookup.startswith(OWN_LOOKUPS)]
    return found



def selected_names(names: Iterable[str], prefixes: Iterable[str]) -> list[str]:
    """The names a converge reads: a prefix ending in '_' selects by start, any other entry whole;
    the receipt's own switches are left out."""
    prefixes = tuple(prefixes)
    starts = tuple(p for p in prefixes if p.endswith("_"))
    return sorted(n for n in set(names)
                  if (n.startswith(starts) or n in prefixes) and not n.startswith(RECEIPT_CONTROLS))


def owning_role(name: str, roles: Iterable[str]) -> str:
    """The role whose variable this is (the longest role name that prefixes it), or ''."""
    owners = [role for role in roles if name.startswith(role + "_")]
    return max(owners, key=len) if owners else ""


def template_selection(template: Callable[[Any, str], Any], variables: Mapping[str, Any], names: Iterable[str],
                       defaults: Mapping[str, Any], roles: Iterable[str]) -> tuple[dict[str, Any], list[str]]:
    """name -> the value the roles will use, and the problems (names whose value cannot be known here).

    `template(raw, role)` templates one raw value with the host's variables and `role_path` of
    `role`; it raises on an undefined variable or a failing filter."""
    roles = list(roles)
    values: dict[str, Any] = {}
    problems: list[str] = []
    for name in names:
        raw = variables[name]
        is_default = name in defaults and _same(raw, defaults[name])
        try:
            values[name] = template(raw, owning_role(name, roles))
        except Exception as exc:  # noqa: BLE001 - Ansible raises many kinds; each means "not known here"
            if is_default:
                values[name] = {"untemplated default": raw}
            else:
                problems.append(f"{name} cannot be templated ({first_line(exc)})")
    return values, problems


def _same(raw: Any, default: Any) -> bool:
    try:
        return bool(raw == default)
    except Exception:  # noqa: BLE001 - exotic types that refuse comparison are treated as set by the user
        return False


def first_line(exc: BaseException) -> str:
    text = str(getattr(exc, "message", "") or exc).strip()
    return (text.splitlines() or [type(exc).__name__])[0][:300]


def inventory_paths(sources: Iterable[str], playbook_dir: str) -> list[str]:
    """The inventory sources and the group_vars/host_vars folders Ansible reads beside them and
    beside the playbook."""
    paths: set[str] = set()
    bases = {playbook_dir} if playbook_dir else set()
    for source in sources:
        if not source or not os.path.exists(source):
            continue
        paths.add(os.path.abspath(source))
        bases.add(os.path.abspath(source if os.path.isdir(source) else os.path.dirname(source)))
    for base in bases:
        paths.update(os.path.join(base, sub) for sub in ("group_vars", "host_vars")
                     if os.path.isdir(os.path.join(base, sub)))
    return sorted(paths)


def files_digest(paths: Iterable[str]) -> dict[str, str]:
    """path -> sha256 of its content (a folder: of every file below it, by relative path)."""
    found: dict[str, str] = {}
    for path in sorted(set(paths)):
        digest = hashlib.sha256()
        if os.path.isfile(path):
            digest.update(_content(path))
        else:
            count = 0
            for folder, dirs, files in os.walk(path):
                dirs.sort()
                for name in sorted(files):
                    full = os.path.join(folder, name)
                    digest.update(f"{os.path.relpath(full, path)}\0".encode() + _content(full) + b"\n")
                    count += 1
                if count >= INVENTORY_WALK_MAX:
                    digest.update(b"(walk stopped)")
                    break
        found[path] = digest.hexdigest()
    return found


def _content(path: str) -> bytes:
    try:
        with open(path, "rb") as handle:
            return hashlib.sha256(handle.read()).digest()
    except OSError as exc:
        return f"unreadable:{exc.errno}".encode()
