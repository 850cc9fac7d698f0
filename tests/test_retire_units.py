"""gptoss.host.retire_units for a unit that belongs to a package (nginx): the decision, in check mode.

Run through `ansible localhost` on temporary trees (this machine has no systemd: check mode asks it
nothing but one `systemctl show`, whose failure reads as "not running"). The real stop, disable and
reload on systemd: tests/test_switches_lab.py and tests/test_webui.py (the reverse_proxy role).
"""

from __future__ import annotations

from pathlib import Path

import pytest
from conftest import run_ansible_module

SERVER = "server {\n    listen 80;\n}\n"


@pytest.fixture
def nginx(tmp_path: Path) -> dict:
    enabled, available, conf_d = tmp_path / "sites-enabled", tmp_path / "sites-available", tmp_path / "conf.d"
    for folder in (enabled, available, conf_d):
        folder.mkdir()
    (available / "gptoss-proxy.conf").write_text(SERVER)
    (enabled / "gptoss-proxy.conf").symlink_to(available / "gptoss-proxy.conf")
    return {"units": ["nginx.service"], "installed_stamp": str(tmp_path / "stamp.json"),
            "in_use": [f"{enabled}/*", f"{conf_d}/*.conf"], "in_use_pattern": r"(?m)^\s*server\s*\{",
            "files": [str(enabled / "gptoss-proxy.conf"), str(available / "gptoss-proxy.conf")],
            "unit_dir": str(tmp_path / "units")}


def test_not_installed_by_us_the_site_goes_and_the_server_is_left_with_the_reason(nginx):
    result = run_ansible_module("retire_units", nginx, "--check", "--diff")
    assert not result["failed"] and result["changed"] is True
    assert result["removed"] == nginx["files"] and result["stopped"] == []
    assert result["kept"]["nginx.service"].startswith("not installed by this configuration")
    assert "left as it is" in result["printed_diff"]


def test_installed_by_us_but_another_site_is_served_it_stays(nginx, tmp_path):
    Path(nginx["installed_stamp"]).write_text("{}")
    other = tmp_path / "sites-enabled" / "default"
    other.write_text("# a comment\n" + SERVER)
    result = run_ansible_module("retire_units", nginx, "--check")
    assert result["stopped"] == [] and result["kept"] == {"nginx.service": f"still in use by {other}"}
    # A file without a server block (comments, an include of ours) does not keep it.
    other.write_text("# server { in a comment does not count\n")
    (tmp_path / "conf.d" / "gzip.conf").write_text("gzip on;\n")
    result = run_ansible_module("retire_units", nginx, "--check")
    assert result["kept"] == {} and result["removed"] == nginx["files"]


def test_nothing_left_is_no_change(nginx, tmp_path):
    for path in nginx["files"]:
        Path(path).unlink()
    result = run_ansible_module("retire_units", nginx, "--check")
    assert not result["failed"] and result["changed"] is False and result["retired"] == []


def test_in_use_without_a_stamp_is_refused(nginx):
    result = run_ansible_module("retire_units", {**nginx, "installed_stamp": None})
    assert result["failed"] and "installed_stamp" in result["msg"]
