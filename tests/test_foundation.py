"""Issue 2: the lab host, check mode on a fresh lab, converge and idempotence, lint."""

from __future__ import annotations

import subprocess

from conftest import ROOT, VENV_BIN, WATCHED_PATHS, Converge, Lab

from lab import nspawn


def test_lab_runs_systemd_as_pid1_and_answers_ssh(fresh_lab: Lab):
    assert fresh_lab.sh("cat /proc/1/comm").strip() == "systemd"
    assert fresh_lab.ssh("systemctl is-system-running", check=False).stdout.strip() in ("running", "degraded")
    # The model disk is a real block device bound into the lab.
    assert fresh_lab.sh(f"stat -c %F {fresh_lab.state.loop_device}").strip() == "block special file"


def test_lab_up_on_a_running_lab_is_a_noop(fresh_lab: Lab):
    state, what = nspawn.up(fresh_lab.state.name)
    assert what == "already running"
    assert state.nspawn_pid == fresh_lab.state.nspawn_pid


def test_second_lab_gets_its_own_address_and_port(fresh_lab: Lab):
    address, port = nspawn.allocate_address(fresh_lab.state.name + "-other")
    assert (address, port) != (fresh_lab.state.address, fresh_lab.state.ssh_port)


def test_check_diff_on_fresh_lab_changes_nothing(converged: Converge):
    assert converged.check_run.rc == 0, converged.check_run.output[-4000:]
    assert converged.check_before == converged.check_after
    # The fresh lab had none of the managed files; check mode must not have created them.
    assert converged.check_before["/etc/systemd/system/gptoss-vllm.service"] == "absent"
    assert "--- before" in converged.check_run.output  # --diff showed what would change


def test_second_converge_reports_no_change(converged: Converge):
    assert converged.second.rc == 0, converged.second.output[-4000:]
    assert converged.second.recap["changed"] == 0, converged.second.output[-6000:]
    assert converged.second.recap["failed"] == 0


def test_converge_leaves_managed_files_in_place(lab: Lab):
    sums = lab.checksums(*WATCHED_PATHS)
    missing = [p for p, s in sums.items() if s == "absent"]
    assert not missing, f"missing after converge: {missing}"


def test_ruff_is_clean():
    result = subprocess.run([str(VENV_BIN / "ruff"), "check", "."], cwd=ROOT, capture_output=True, text=True)
    assert result.returncode == 0, result.stdout + result.stderr


def test_ansible_lint_is_clean():
    result = subprocess.run([str(VENV_BIN / "ansible-lint"), "--offline", "-q", "site.yml", "roles", "playbooks",
                             "collections"],
                            cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stdout[-6000:] + result.stderr[-3000:]
