"""Versioned vLLM venvs side by side, and the pointer symlink the unit runs through.

One home for the rules that the venv builder (modules/vllm_venv), the transaction
(modules/vllm_change) and verify (service/host/checks.py, SVC-005) share: how a venv is named, when it
is complete, where the pointer points, which venvs retention may remove.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import re
import shutil

from ansible_collections.gptoss.host.plugins.module_utils import atomic_file

# Written last by the builder: a venv without it is half-built (a killed play) and is never used.
MANIFEST = "gptoss-venv.json"


def inputs_hash(package: str, version: str, pip_args: list[str], remove_packages: list[str],
                system_python: str, requirements: list[str] | tuple[str, ...] = ()) -> str:
    """Short hash of everything that decides a venv's content; another input means another venv.
    `requirements` (more pinned packages beside `package`, e.g. the GPU exporter's) count only when given,
    so a vLLM venv keeps the name it had before they existed."""
    inputs = {"package": package, "version": version, "pip_args": list(pip_args),
              "remove_packages": sorted(remove_packages), "system_python": system_python}
    if requirements:
        inputs["requirements"] = sorted(requirements)
    canonical = json.dumps(inputs, sort_keys=True)
    return hashlib.sha256(canonical.encode()).hexdigest()[:10]


def venv_name(package: str, version: str, digest: str) -> str:
    """<package>-<version>-<hash>: the package and version stay readable in `ls` and in verify."""
    if not re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9._-]*", f"{package}-{version}"):
        raise ValueError(f"{package!r} {version!r}: not a package name and version usable in a path")
    return f"{package}-{version}-{digest}"


def read_manifest(venv: str) -> dict | None:
    """The manifest of a complete venv, or None (half-built, absent, unreadable)."""
    try:
        with open(os.path.join(venv, MANIFEST), encoding="utf-8") as handle:
            data = json.load(handle)
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) else None


def write_manifest(venv: str, manifest: dict) -> None:
    text = json.dumps(manifest, indent=2, sort_keys=True) + "\n"
    atomic_file.write_atomically(os.path.join(venv, MANIFEST), text, 0o644)


def pointer_target(pointer: str) -> str | None:
    """Where the pointer symlink points (absolute); None when it is absent. A real directory there
    (the layout before versioned venvs) is reported by `is_legacy_dir`, not here."""
    if not os.path.islink(pointer):
        return None
    target = os.readlink(pointer)
    return os.path.normpath(os.path.join(os.path.dirname(pointer), target))


def is_legacy_dir(pointer: str) -> bool:
    return os.path.isdir(pointer) and not os.path.islink(pointer)


def switch_pointer(pointer: str, target: str | None) -> None:
    """Point `pointer` at `target` atomically (a symlink under a temporary name, then rename(2)), so
    that every reader sees the old or the new venv, never none. None removes the pointer."""
    if target is None:
        with contextlib.suppress(FileNotFoundError):
            if os.path.islink(pointer):
                os.unlink(pointer)
        return
    if is_legacy_dir(pointer):
        raise OSError(f"{pointer} is a real directory, not a pointer; adopt it first")
    os.makedirs(os.path.dirname(pointer), exist_ok=True)
    tmp = os.path.join(os.path.dirname(pointer), f".{os.path.basename(pointer)}.{os.getpid()}.tmp")
    with contextlib.suppress(FileNotFoundError):
        os.unlink(tmp)
    os.symlink(target, tmp)
    os.replace(tmp, pointer)


def complete_venvs(venvs_dir: str) -> list[tuple[str, dict]]:
    """Every complete venv under venvs_dir, oldest build first."""
    found = []
    with contextlib.suppress(FileNotFoundError):
        for name in os.listdir(venvs_dir):
            path = os.path.join(venvs_dir, name)
            manifest = read_manifest(path) if not name.startswith(".") and os.path.isdir(path) else None
            if manifest is not None:
                found.append((path, manifest))
    return sorted(found, key=lambda item: (float(item[1].get("built_epoch", 0)), item[0]))


def venvs_to_remove(venvs_dir: str, keep: int, protected: set[str], recent_targets: list[str]) -> list[str]:
    """Complete venvs beyond the newest `keep`: the newest are those the pointer pointed at most
    recently (recent_targets, newest first), then the newest builds. Protected ones (the pointer's
    target, the running process's venv) are never removed."""
    venvs = [path for path, _ in complete_venvs(venvs_dir)]
    order: list[str] = []
    for path in [*recent_targets, *reversed(venvs)]:
        if path in venvs and path not in order:
            order.append(path)
    kept = set(order[:max(keep, 1)]) | {os.path.normpath(p) for p in protected if p}
    return [path for path in venvs if path not in kept]


def remove_venv(path: str) -> None:
    """Remove a venv: its manifest first, so that a removal cut short leaves a half-built venv
    (never used, rebuilt when wanted) rather than a complete-looking broken one."""
    with contextlib.suppress(FileNotFoundError):
        os.unlink(os.path.join(path, MANIFEST))
    shutil.rmtree(path, ignore_errors=True)


def venv_of_process(pid: int, venvs_dir: str) -> str | None:
    """The versioned venv a running process loaded its libraries from. The kernel resolves
    symlinks in /proc/PID/maps, so this is the venv the process really runs, whatever the
    pointer says now (the interpreter itself is the system Python the venv links to)."""
    prefix = os.path.normpath(venvs_dir) + os.sep
    with open(f"/proc/{pid}/maps", encoding="utf-8", errors="replace") as handle:
        for line in handle:
            fields = line.split(None, 5)
            if len(fields) == 6 and fields[5].startswith(prefix):
                return prefix + fields[5][len(prefix):].split(os.sep, 1)[0]
    return None


def free_mib(path: str) -> int:
    """Free space (MiB) on the filesystem that holds `path` or its nearest existing parent."""
    probe = path
    while not os.path.exists(probe):
        probe = os.path.dirname(probe) or "/"
    return shutil.disk_usage(probe).free // (1 << 20)


VLLM_SPACE_SETTING = "vllm_service_venv_min_free_gib"
VLLM_SPACE_REMEDY = "Free space, or lower vllm_service_keep_venvs and converge once to prune."


def space_problem(venvs_dir: str, min_free_mib: int, package: str, version: str,
                  setting: str = VLLM_SPACE_SETTING, remedy: str = VLLM_SPACE_REMEDY) -> str | None:
    """None when a new venv fits under `venvs_dir`, else the refusal (space_refusal, on a fresh reading)."""
    return space_refusal(venvs_dir, free_mib(venvs_dir), min_free_mib, package, version, setting, remedy)


def space_refusal(venvs_dir: str, free: int, min_free_mib: int, package: str, version: str,
                  setting: str = VLLM_SPACE_SETTING, remedy: str = VLLM_SPACE_REMEDY) -> str | None:
    """The rule on a reading `free` of free_mib: None when it fits, else the refusal, naming the role
    variable that sets the bound. `free` is what an unprivileged process may use (root's reserved blocks
    not counted): a service user fills the rest (Open WebUI's first start could not write its database
    where pip, as root, had just filled the disk into the reserve)."""
    if free >= min_free_mib:
        return None
    return (f"{venvs_dir} has {free} MiB free, the {package} {version} venv needs {min_free_mib} MiB "
            f"({setting}); refused before building, nothing was changed. {remedy}")


# The inputs that name a venv (its hash) and where it goes: one argument spec for the modules that
# take them (vllm_venv builds the venv, vllm_inputs checks them before anything changes).
VENV_INPUT_SPEC = {
    "package": {"type": "str", "required": True},
    "version": {"type": "str", "required": True},
    "pip_args": {"type": "list", "elements": "str", "default": []},
    "remove_packages": {"type": "list", "elements": "str", "default": []},
    "system_python": {"type": "path", "default": "/usr/bin/python3"},
    "venvs_dir": {"type": "path", "default": "/opt/gptoss/venvs"},
    "min_free_mib": {"type": "int", "default": 15360},
}
