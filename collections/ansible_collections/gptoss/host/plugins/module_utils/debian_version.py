"""Debian version strings compared the way dpkg compares them (deb-version(7)).

Standard library only: this file is shipped to the managed host with the modules that import it,
and the controller's tests import it too. The tests check every rule against the real
`dpkg --compare-versions`.
"""

from __future__ import annotations

import re

_VALID = re.compile(r"^(?:(\d+):)?([0-9][A-Za-z0-9.+~:-]*?)(?:-([A-Za-z0-9.+~]+))?$")


def split_version(version: str) -> tuple[int, str, str]:
    """(epoch, upstream, revision) of a Debian version; a missing epoch is 0, a missing revision ''."""
    text = version.strip()
    match = _VALID.match(text)
    if not match or text.endswith("-"):  # a hyphen promises a revision (dpkg: "revision number is empty")
        raise ValueError(f"not a Debian version: {version!r}")
    epoch, upstream, revision = match.groups()
    if ":" in upstream and epoch is None:
        # A colon in the upstream part is allowed only after an epoch (deb-version(7)).
        raise ValueError(f"not a Debian version: {version!r}")
    return int(epoch or 0), upstream, revision or ""


def _order(char: str) -> int:
    """dpkg's weight of one non-digit character: '~' sorts before everything, even the end."""
    if char == "~":
        return -1
    if char.isalpha():
        return ord(char)
    return ord(char) + 256


def _compare_part(left: str, right: str) -> int:
    """dpkg's verrevcmp on an upstream version or a revision: -1, 0 or 1."""
    i = j = 0
    while i < len(left) or j < len(right):
        # Non-digit run, character by character; the end of a string weighs 0.
        while (i < len(left) and not left[i].isdigit()) or (j < len(right) and not right[j].isdigit()):
            a = _order(left[i]) if i < len(left) and not left[i].isdigit() else 0
            b = _order(right[j]) if j < len(right) and not right[j].isdigit() else 0
            if a != b:
                return -1 if a < b else 1
            if i < len(left) and not left[i].isdigit():
                i += 1
            if j < len(right) and not right[j].isdigit():
                j += 1
        # Digit run, numerically (leading zeros do not count).
        start_i, start_j = i, j
        while i < len(left) and left[i].isdigit():
            i += 1
        while j < len(right) and right[j].isdigit():
            j += 1
        a_num = int(left[start_i:i] or 0)
        b_num = int(right[start_j:j] or 0)
        if a_num != b_num:
            return -1 if a_num < b_num else 1
    return 0


def compare_versions(left: str, right: str) -> int:
    """-1, 0 or 1, as `dpkg --compare-versions LEFT lt|eq|gt RIGHT` would answer."""
    l_epoch, l_upstream, l_revision = split_version(left)
    r_epoch, r_upstream, r_revision = split_version(right)
    if l_epoch != r_epoch:
        return -1 if l_epoch < r_epoch else 1
    return _compare_part(l_upstream, r_upstream) or _compare_part(l_revision, r_revision)


def upstream_version(version: str) -> str:
    """The upstream part: '1:580.95.05-0ubuntu0.24.04.1' -> '580.95.05'.

    A driver's own version (what /proc/driver/nvidia/version and NVML report) is the upstream part;
    epochs and revisions are packaging details of one archive or another.
    """
    return split_version(version)[1]


def driver_at_least(package_version: str, required: str) -> bool:
    """Does a driver package of this Debian version carry a driver at or above `required`?"""
    return _compare_part(upstream_version(package_version), required.strip()) >= 0
