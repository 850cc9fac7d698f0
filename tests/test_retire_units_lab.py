"""gptoss.host.retire_units on the lab's real systemd: the one way the roles take a unit off a host.

The roles' own retire paths run in tests/test_replicas_lab.py (instances and the router) and
tests/test_webui.py (the UI); here the module's contract: check mode, diff, order, keep, leftovers.
"""

from __future__ import annotations

import json
import subprocess

import pytest
from conftest import ROOT, VENV_BIN, Lab

STEM = "gptoss-retiretest"
UNIT = """[Unit]
Description=retire_units test unit {instance}
[Service]
ExecStart=/bin/sleep infinity
[Install]
WantedBy=multi-user.target
"""
FILES = ["/etc/gptoss/retiretest@{instance}.json", "/var/lib/gptoss/retiretest-{instance}"]


def retire_units(lab: Lab, args: dict, *flags: str) -> dict:
    """The module through ansible against the lab, as a role runs it: its JSON result."""
    env = {**lab.env, "ANSIBLE_STDOUT_CALLBACK": "ansible.builtin.minimal", "ANSIBLE_LOAD_CALLBACK_PLUGINS": "1",
           "ANSIBLE_CALLBACK_RESULT_FORMAT": "json"}
    proc = subprocess.run([str(VENV_BIN / "ansible"), "gptoss_hosts", "-b", *flags, "-m", "gptoss.host.retire_units",
                           "-a", json.dumps(args)], cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
    head, arrow, body = proc.stdout.partition("=>")
    assert arrow, proc.stdout + proc.stderr
    return {**json.loads(body), "failed": "FAILED" in head, "printed_diff": head}


def unit_state(lab: Lab, unit: str) -> str:
    return lab.ssh(f"systemctl is-active {unit}; systemctl is-enabled {unit}", check=False).stdout.split()[0:2]


@pytest.fixture
def two_instances(lab: Lab):
    script = []
    for instance in ("a", "b"):
        unit = f"/etc/systemd/system/{STEM}@{instance}.service"
        script += [f"printf '%s' '{UNIT.format(instance=instance)}' > {unit}",
                   f"echo '{{}}' > /etc/gptoss/retiretest@{instance}.json",
                   f"mkdir -p /var/lib/gptoss/retiretest-{instance}",
                   f"echo x > /var/lib/gptoss/retiretest-{instance}/f"]
    lab.sh(" && ".join(script) + f" && systemctl daemon-reload && systemctl enable --now {STEM}@a {STEM}@b")
    yield
    lab.ssh(f"systemctl disable --now {STEM}@a {STEM}@b; rm -rf /etc/systemd/system/{STEM}@* /etc/gptoss/retiretest@* "
            "/var/lib/gptoss/retiretest-*; systemctl daemon-reload; systemctl reset-failed", check=False)


def present(lab: Lab, instance: str) -> list[str]:
    paths = [path.format(instance=instance) for path in FILES] + [f"/etc/systemd/system/{STEM}@{instance}.service"]
    return lab.sh(f"ls -d {' '.join(paths)} 2>/dev/null || true").split()


def test_check_mode_names_what_would_go_and_touches_nothing(lab: Lab, two_instances):
    args = {"pattern": f"{STEM}@*.service", "keep": [f"{STEM}@b.service"], "files": FILES}
    result = retire_units(lab, args, "--check", "--diff")
    assert not result["failed"] and result["changed"] is True
    assert result["retired"] == [f"{STEM}@a.service"]
    # Files first, the unit file last: a retire cut short is found again by its unit file.
    assert result["removed"] == ["/etc/gptoss/retiretest@a.json", "/var/lib/gptoss/retiretest-a",
                                 f"/etc/systemd/system/{STEM}@a.service"]
    assert "/var/lib/gptoss/retiretest-a" in result["printed_diff"]
    assert unit_state(lab, f"{STEM}@a") == ["active", "enabled"]
    assert len(present(lab, "a")) == 3


def test_retires_the_unit_not_kept_and_then_changes_nothing(lab: Lab, two_instances):
    args = {"pattern": f"{STEM}@*.service", "keep": [f"{STEM}@b.service"], "files": FILES}
    result = retire_units(lab, args)
    assert not result["failed"] and result["changed"] is True and result["retired"] == [f"{STEM}@a.service"]
    assert present(lab, "a") == []
    assert unit_state(lab, f"{STEM}@a")[0] == "inactive"
    assert lab.ssh(f"systemctl list-units --all --no-legend '{STEM}@a.service'", check=False).stdout.strip() == ""
    assert unit_state(lab, f"{STEM}@b") == ["active", "enabled"] and len(present(lab, "b")) == 3
    again = retire_units(lab, args)
    assert not again["failed"] and again["changed"] is False and again["retired"] == []


def test_leftover_files_without_a_unit_are_removed_and_a_missing_unit_is_nothing(lab: Lab, two_instances):
    # An install that failed before its unit was written: the files go, no systemctl call is needed.
    lab.sh("mkdir -p /var/lib/gptoss/retiretest-left && echo x > /var/lib/gptoss/retiretest-left/f")
    result = retire_units(lab, {"units": [f"{STEM}-left.service", f"{STEM}-never.service"],
                                "files": ["/var/lib/gptoss/retiretest-left"]})
    assert not result["failed"] and result["retired"] == [f"{STEM}-left.service"]
    assert result["removed"] == ["/var/lib/gptoss/retiretest-left"]
    assert lab.sh("ls -d /var/lib/gptoss/retiretest-left 2>/dev/null || echo gone").strip() == "gone"
