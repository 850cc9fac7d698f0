"""gptoss.host.deb_missing through ansible on this machine (a Debian controller: dpkg's real database)."""

from __future__ import annotations

import subprocess

from conftest import run_ansible_module


def installed(package: str) -> bool:
    proc = subprocess.run(["dpkg-query", "-W", "-f", "${db:Status-Status}", package], capture_output=True, text=True)
    return proc.stdout == "installed"


def test_names_only_what_dpkg_does_not_have_installed():
    assert installed("dpkg") and installed("python3-venv")
    names = ["python3-venv", "gptoss-no-such-package", "dpkg:amd64", "dpkg"]
    result = run_ansible_module("deb_missing", {"names": names})
    assert not result["failed"] and result["changed"] is False
    assert result["missing"] == ["gptoss-no-such-package"]


def test_names_with_a_version_release_or_wildcard_are_left_to_apt():
    names = ["dpkg=0.0-no-such-version", "dpkg/bookworm", "python3-*", "dpkg"]
    result = run_ansible_module("deb_missing", {"names": names}, "--check")
    assert not result["failed"]
    assert result["missing"] == names[:3]


def test_nothing_to_ask_returns_nothing():
    assert run_ansible_module("deb_missing", {"names": []})["missing"] == []
