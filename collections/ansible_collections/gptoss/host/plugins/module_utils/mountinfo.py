"""/proc/self/mountinfo: parsing, and whether a mount has the options asked for. The one home of both.

Called by the ``gptoss.host.fstab`` module (the options of the live mount after a remount), by
verify (MNT-001) and by preflight (DISK). Runs on the host's system python and in Ansible
modules: standard library only.
"""

from __future__ import annotations

import posixpath
import re
from collections.abc import Iterable
from typing import Any

PROC_MOUNTINFO = "/proc/self/mountinfo"
# Options the kernel reports under another spelling than fstab uses (ext4 shows nobarrier as it was
# given or as barrier=0, depending on the kernel).
OPTION_ALIASES = {"nobarrier": frozenset({"nobarrier", "barrier=0"})}
# Options that only say "the defaults": the kernel never reports them.
DEFAULT_OPTIONS = frozenset({"defaults"})


def unescape(field: str) -> str:
    """proc(5) and fstab(5) escape space, tab, newline and backslash as \\ooo octal."""
    return re.sub(r"\\([0-7]{3})", lambda m: chr(int(m.group(1), 8)), field)


def parse(text: str) -> list[dict[str, Any]]:
    """mountinfo lines -> mount_point, root, fstype, source, mount options, super options."""
    mounts = []
    for line in text.splitlines():
        left, sep, right = line.partition(" - ")
        fields, tail = left.split(), right.split()
        if not sep or len(fields) < 6 or len(tail) < 2:
            continue
        mounts.append({
            "mount_id": int(fields[0]),
            "root": unescape(fields[3]),
            "mount_point": unescape(fields[4]),
            "mount_options": fields[5].split(","),
            "fstype": tail[0],
            "source": unescape(tail[1]),
            "super_options": tail[2].split(",") if len(tail) > 2 else [],
        })
    return mounts


def mount_at(text: str, point: str) -> dict[str, Any] | None:
    """The mount paths under `point` resolve to: the last one listed there (the one on top)."""
    wanted = {point, point.rstrip("/") or "/"}
    found = [m for m in parse(text) if m["mount_point"] in wanted]
    return found[-1] if found else None


def read_mount_at(point: str, path: str = PROC_MOUNTINFO) -> dict[str, Any] | None:
    with open(path, encoding="utf-8", errors="replace") as handle:
        return mount_at(handle.read(), point)


def live_options(mount: dict[str, Any]) -> set[str]:
    """Per-mount and super-block options together: where the kernel reports each varies."""
    return set(mount["mount_options"]) | set(mount["super_options"])


def missing_options(wanted: list[str], mount: dict[str, Any]) -> list[str]:
    """The options of `wanted` that the live mount does not have (aliases honoured, 'defaults' skipped)."""
    have = live_options(mount)
    return [o for o in wanted if o not in DEFAULT_OPTIONS and not OPTION_ALIASES.get(o, frozenset({o})) & have]


def mount_point_of(path: str, mount_points: Iterable[str]) -> str:
    """The mount point `path` lives on: the longest of `mount_points` containing it ('/' when none does).

    The monitoring rules select a file system's free space by node exporter's `mountpoint` label."""
    path = posixpath.normpath("/" + path.lstrip("/"))
    best = "/"
    for point in mount_points:
        point = posixpath.normpath(point)
        if (path == point or path.startswith(point.rstrip("/") + "/")) and len(point) > len(best):
            best = point
    return best
