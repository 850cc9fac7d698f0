"""The converge receipt: proof that a host is as the last full converge left it, with the same inputs.

A full converge that succeeds ends by writing ``/var/lib/gptoss/converge-receipt.json``: a digest of
its inputs (computed on the controller: the project's roles, playbooks, templates, collection and
host code; every ``<role>_*`` variable of every host; the facts the roles read; the controller files
the roles copy from) and digests of the live state the roles manage, read on the host:

- ``files:<path>``: every watched path (the project's folders, the units, GRUB, modprobe, fstab,
  apt sources, nginx, plus every path the verify records name: the model, the venvs, the unit's
  inputs). A file up to 1 MiB is hashed; a larger one (weights, libraries) by size and mtime;
  a venv by its manifest, ``pyvenv.cfg`` and the listing of ``site-packages`` (what pip changes);
- ``units``: load, active, sub and enablement state, main PID and restarts of the project's units;
- ``boot``: the boot id (a reboot always runs the whole converge);
- ``kernel``: ``/proc/cmdline`` and the loaded NVIDIA driver's parameters;
- ``mounts``: the mountinfo lines of the watched mount points;
- ``cpu``: every CPU's scaling governor;
- ``packages``, ``accounts``: dpkg's status file, ``/etc/passwd`` and ``/etc/group``.

The next converge asks first (one module call): same inputs and same state, so every role would
find nothing to do, and the play ends for that host; anything different (which part is said), a
receipt older than its maximum age, or inputs that could not be computed ahead, and the whole
converge runs, then writes a new receipt. ``tests/test_converge_receipt_lab.py`` proves on
the lab that every file a converge writes is watched, and that drift in each part is seen.

Runs on the host (the module, standard library only) and on the controller (the inputs digest).
"""

from __future__ import annotations

import datetime
import fnmatch
import hashlib
import json
import os
import stat
from collections.abc import Iterable, Mapping
from typing import Any

from ansible_collections.gptoss.host.plugins.module_utils import mountinfo

# 2: the inputs are the templated values (plugin_utils/receipt_inputs.py); the boot id is a part of its own.
RECEIPT_FORMAT = 2
# Files up to this size are hashed; larger ones (weights, shared libraries) by size and mtime.
HASHED_FILE_MAX = 1 << 20
# Written by the processes themselves, never by a converge: bytecode caches.
ALWAYS_SKIPPED = ("__pycache__",)
# A venv is watched by what says what is installed in it, not by its tens of thousands of files.
VENV_MARKER = "pyvenv.cfg"
VENV_MANIFESTS = ("pyvenv.cfg", "gptoss-venv.json")
UNIT_PROPERTIES = ("Id", "LoadState", "ActiveState", "SubState", "UnitFileState", "MainPID", "NRestarts",
                   "NeedDaemonReload", "FragmentPath", "DropInPaths")
# Controller paths named by variables: a walk stops here (a variable that names "/" must not hang).
CONTROLLER_WALK_MAX = 20000


def _sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def _file_line(path: str, st: os.stat_result) -> str:
    kind = stat.S_IFMT(st.st_mode)
    head = f"{oct(st.st_mode & 0o7777)} {st.st_uid}:{st.st_gid}"
    if kind == stat.S_IFLNK:
        return f"{path} link {head} -> {os.readlink(path)}"
    if kind == stat.S_IFDIR:
        return f"{path} dir {head}"
    if kind != stat.S_IFREG:
        return f"{path} other {head} {kind}"
    if st.st_size <= HASHED_FILE_MAX:
        try:
            with open(path, "rb") as handle:
                return f"{path} file {head} sha256:{_sha256(handle.read())}"
        except OSError as exc:
            return f"{path} file {head} unreadable:{exc.errno}"
    return f"{path} file {head} size:{st.st_size} mtime:{st.st_mtime_ns}"


def _venv_lines(root: str) -> list[str]:
    """A venv: its manifest files, and the names in each site-packages (pip adds or removes a
    .dist-info there for every install, upgrade or removal)."""
    lines = []
    for name in VENV_MANIFESTS:
        path = os.path.join(root, name)
        if os.path.lexists(path):
            lines.append(_file_line(path, os.lstat(path)))
    for lib in ("lib", "lib64"):
        lib_dir = os.path.join(root, lib)
        if not os.path.isdir(lib_dir) or os.path.islink(lib_dir):
            continue
        for python in sorted(os.listdir(lib_dir)):
            site = os.path.join(lib_dir, python, "site-packages")
            if os.path.isdir(site):
                lines.append(f"{site} listing " + _sha256("\n".join(sorted(os.listdir(site))).encode()))
    return lines


def tree_lines(root: str, skip: Iterable[str] = ()) -> list[str]:
    """One line per entry under `root` (root included, symlinks not followed); a missing root is one
    line. Names matching a `skip` pattern (and bytecode caches) are left out with what is below them."""
    patterns = tuple(skip) + ALWAYS_SKIPPED
    try:
        st = os.lstat(root)
    except FileNotFoundError:
        return [f"{root} missing"]
    lines = [_file_line(root, st)]
    if not stat.S_ISDIR(st.st_mode):
        return lines
    if os.path.exists(os.path.join(root, VENV_MARKER)):
        return lines + _venv_lines(root)
    try:
        names = sorted(os.listdir(root))
    except OSError as exc:
        return lines + [f"{root} unlistable:{exc.errno}"]
    for name in names:
        if any(fnmatch.fnmatchcase(name, pattern) for pattern in patterns):
            continue
        lines += tree_lines(os.path.join(root, name), skip)
    return lines


def watched_paths(watch: Iterable[str], records_dir: str) -> list[str]:
    """The watch list plus every absolute path a verify record names (the model folder, the venv
    pointer and venvs folder, the files the unit reads, the router's configuration, ...): the paths
    that role variables choose are watched wherever they were put."""
    paths = set(watch)
    try:
        names = sorted(n for n in os.listdir(records_dir) if n.endswith(".json"))
    except FileNotFoundError:
        names = []
    for name in names:
        try:
            with open(os.path.join(records_dir, name), encoding="utf-8") as handle:
                record = json.load(handle)
        except (OSError, ValueError):
            continue  # the record file itself is watched; a broken one is a change there
        paths.update(_absolute_paths(record))
    # A path below another watched path is already covered by the walk of its parent.
    ordered = sorted(os.path.normpath(p) for p in paths)
    return [p for p in ordered if not any(p != q and p.startswith(q.rstrip("/") + "/") for q in ordered)]


# Never walked, whatever a record names: the root itself and the kernel's virtual file systems.
NOT_WALKED = ("/proc", "/sys", "/dev", "/run")


def _absolute_paths(value: Any) -> list[str]:
    if isinstance(value, str):
        path = os.path.normpath(value) if value.startswith("/") else ""
        if not path or path == "/" or "\n" in value or " " in value or \
                any(path == top or path.startswith(top + "/") for top in NOT_WALKED):
            return []
        return [value]
    if isinstance(value, Mapping):
        return [p for item in value.values() for p in _absolute_paths(item)]
    if isinstance(value, list):
        return [p for item in value for p in _absolute_paths(item)]
    return []


def mount_lines(mountinfo_text: str, points: Iterable[str]) -> list[str]:
    """The mounts at the watched paths' mount points, as module_utils/mountinfo.py parses them, without
    the mount ids (which a remount of anything else can renumber): root, point, source, fstype, options."""
    wanted = set(points)
    return sorted(json.dumps({k: v for k, v in mount.items() if k != "mount_id"}, sort_keys=True)
                  for mount in mountinfo.parse(mountinfo_text) if mount["mount_point"] in wanted)


def _read(path: str) -> str:
    try:
        with open(path, "rb") as handle:
            return _sha256(handle.read())
    except FileNotFoundError:
        return "missing"
    except OSError as exc:
        return f"unreadable:{exc.errno}"


def state_digests(watch: Iterable[str], records_dir: str, unit_text: str, skip: Iterable[str] = (),
                  proc: str = "/proc", sys_cpu: str = "/sys/devices/system/cpu") -> dict[str, str]:
    """part -> sha256 of the live state the roles manage (see the module docstring). `unit_text` is
    `systemctl show` of the project's units (the module runs systemctl; this stays pure)."""
    paths = watched_paths(watch, records_dir)
    skip = tuple(skip)
    digests = {f"files:{path}": _sha256("\n".join(tree_lines(path, skip)).encode()) for path in paths}
    digests["units"] = _sha256(unit_text.encode())
    digests["boot"] = _read(os.path.join(proc, "sys/kernel/random/boot_id"))
    digests["kernel"] = _sha256("\n".join(
        _read(os.path.join(proc, name)) for name in ("cmdline", "driver/nvidia/params")).encode())
    try:
        with open(os.path.join(proc, "self/mountinfo"), encoding="utf-8", errors="replace") as handle:
            mountinfo_text = handle.read()
    except OSError:
        mountinfo_text = ""
    points = {"/"} | {os.path.dirname(p) for p in paths} | set(paths)
    digests["mounts"] = _sha256("\n".join(mount_lines(mountinfo_text, points)).encode())
    governors = sorted(n for n in (os.listdir(sys_cpu) if os.path.isdir(sys_cpu) else [])
                       if n.startswith("cpu") and n[3:].isdigit())
    digests["cpu"] = _sha256("\n".join(
        f"{n} {_read(os.path.join(sys_cpu, n, 'cpufreq/scaling_governor'))}" for n in governors).encode())
    digests["packages"] = _read("/var/lib/dpkg/status")
    digests["accounts"] = _sha256((_read("/etc/passwd") + _read("/etc/group")).encode())
    return digests


# Why a part differs, in the play's words (the others are named as they are).
PART_REASONS = {"boot": "boot (the host rebooted since the receipt)"}


def receipt_age_s(receipt: Mapping[str, Any], now: datetime.datetime) -> float | None:
    """Seconds since the receipt was written; None when its time cannot be read."""
    try:
        written = datetime.datetime.fromisoformat(str(receipt.get("written_at")))
    except ValueError:
        return None
    if written.tzinfo is None:
        return None
    return (now - written).total_seconds()


def differing_parts(receipt: Mapping[str, Any] | None, inputs: str, state: Mapping[str, str],
                    input_problems: Iterable[str] = (), max_age_s: int = 0,
                    now: datetime.datetime | None = None) -> list[str]:
    """Why the receipt does not vouch for this run: [] when it does. `max_age_s` > 0: a receipt
    older than that vouches for nothing (a full converge now and then, whatever the digests say)."""
    problems = [f"inputs not computable ahead: {problem}" for problem in input_problems]
    if not receipt:
        return ["no receipt (no full converge has finished here)", *problems]
    if receipt.get("format") != RECEIPT_FORMAT:
        return [f"receipt format {receipt.get('format')!r} (want {RECEIPT_FORMAT})", *problems]
    parts = problems or ([] if receipt.get("inputs") == inputs
                         else ["inputs (project files, variables, inventory or controller files)"])
    if max_age_s > 0:
        age = receipt_age_s(receipt, now or datetime.datetime.now(datetime.UTC))
        if age is None or age > max_age_s:
            parts.append(f"receipt age ({'unknown' if age is None else f'{age / 3600:.1f} h'}; "
                         f"gptoss_base_receipt_max_age_s: {max_age_s})")
    old = receipt.get("state") or {}
    parts += sorted(PART_REASONS.get(part, part) for part in set(old) | set(state) if old.get(part) != state.get(part))
    return parts


def receipt_text(inputs: str, state: Mapping[str, str], notices: list[str], written_at: str) -> str:
    return json.dumps({"format": RECEIPT_FORMAT, "inputs": inputs, "state": dict(state), "notices": notices,
                       "written_at": written_at}, indent=2, sort_keys=True) + "\n"


# ---------------------------------------------------------------- the controller's side


def _controller_tree(path: str) -> list[str]:
    """A controller path a variable names: each file by size and mtime (a model folder must not be
    read whole on every run), at most CONTROLLER_WALK_MAX entries."""
    lines: list[str] = []
    for folder, dirs, files in os.walk(path):
        dirs.sort()
        for name in sorted(files):
            full = os.path.join(folder, name)
            try:
                st = os.stat(full)
            except OSError:
                continue
            lines.append(f"{full} {st.st_size} {st.st_mtime_ns}")
            if len(lines) >= CONTROLLER_WALK_MAX:
                return lines + ["(walk stopped)"]
    return lines


def controller_paths_digest(paths: Iterable[str]) -> dict[str, str]:
    """path -> digest of the controller files the roles copy from (a folder: each file's size and mtime)."""
    found: dict[str, str] = {}
    for path in sorted(set(paths)):
        if os.path.isdir(path):
            found[path] = _sha256("\n".join(_controller_tree(path)).encode())
        else:
            found[path] = _read(path)
    return found


def source_tree_digest(roots: Iterable[str]) -> str:
    """The project's own files (roles, playbooks, templates, collection, host code), by content."""
    digest = hashlib.sha256()
    for root in sorted(set(roots)):
        if os.path.isfile(root):
            digest.update(f"{root} {_read(root)}\n".encode())
            continue
        for folder, dirs, files in os.walk(root):
            dirs[:] = sorted(d for d in dirs if d not in ALWAYS_SKIPPED)
            for name in sorted(files):
                full = os.path.join(folder, name)
                digest.update(f"{os.path.relpath(full, root)} {_read(full)}\n".encode())
    return digest.hexdigest()


def inputs_digest(sources: str, variables: Mapping[str, Any], controller_files: Mapping[str, str]) -> str:
    blob = json.dumps({"sources": sources, "variables": variables, "controller_files": controller_files},
                      sort_keys=True, default=str)
    return _sha256(blob.encode())
