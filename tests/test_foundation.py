"""Issue 2: the lab host, check mode on a fresh lab, converge and idempotence, lint."""

from __future__ import annotations

import subprocess

import jinja2
import yaml
from ansible_collections.gptoss.host.plugins.module_utils import converge_receipt
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
    # The receipt switched off: every role runs and finds nothing to do (the roles' own idempotence).
    assert converged.second.rc == 0, converged.second.output[-4000:]
    assert "TASK [vllm_service : Roll out as one transaction" in converged.second.output
    assert converged.second.recap["changed"] == 0, converged.second.output[-6000:]
    assert converged.second.recap["failed"] == 0


def test_third_converge_ends_on_the_receipt(converged: Converge):
    third = converged.third
    assert third.rc == 0 and third.recap["changed"] == 0 and third.recap["failed"] == 0, third.output[-4000:]
    said = " ".join(third.output.split())  # the YAML callback folds long messages
    assert "holds: inputs and managed live state unchanged, nothing to do" in said, third.output[-4000:]
    # The lab's kernel flags never go live (it shares the controller's kernel): the notice stays.
    assert "REBOOT REQUIRED: nvidia.NVreg_" in said
    assert "TASK [vllm_service" not in third.output and "TASK [nccl_env" not in third.output
    print(f"[must-show] no-op converge: {converged.second.seconds:.1f} s with every role, "
          f"{third.seconds:.1f} s ended by the receipt")


def receipt_watch(lab: Lab) -> list[str]:
    """gptoss_base's watch list as the role renders it, plus the paths the lab's verify records name."""
    defaults = yaml.safe_load((ROOT / "roles/gptoss_base/defaults/main.yml").read_text())
    watch = [jinja2.Template(path).render(defaults) for path in defaults["gptoss_base_receipt_watch"]]
    records = lab.state.root / "etc/gptoss/verify.d"
    return converge_receipt.watched_paths(watch, str(records))


def test_every_file_the_converge_writes_is_watched_by_the_receipt(converged: Converge, lab: Lab):
    """The receipt can vouch only for what it watches: every file the fresh converge wrote is under a
    watched path, or a package's file (dpkg's status, which the receipt hashes, changed with it)."""
    assert converged.written, "the marker saw no file written: the search is broken"
    listed = lab.sh("cat /var/lib/dpkg/info/*.list").splitlines()
    # Debian 12 is merged-/usr: a package lists /lib/systemd/system/x.service, the search finds /usr/lib/...
    packaged = set(listed) | {"/usr" + path for path in listed if path.startswith(MERGED_USR)}
    watch = receipt_watch(lab)
    unwatched = [path for path in converged.written if path not in packaged and not receipt_sees(path, watch)
                 and not path.startswith(PACKAGE_SCRIPT_OUTPUT)]
    assert not unwatched, f"written by the converge, not watched by the receipt: {unwatched}"
    print(f"[must-show] the converge wrote {len(converged.written)} files; every one is watched or a package's")


# Written by packages' maintainer scripts and triggers while apt installs (not by a role): an install
# changes dpkg's status file, which the receipt hashes.
# update-rc.d's links of a package's init script; javascript-common's lighttpd alias (a dependency of
# Debian's Prometheus web UI) enabled by its postinst.
PACKAGE_SCRIPT_OUTPUT = ("/etc/ld.so.cache", *(f"/etc/rc{level}.d/" for level in "0123456S"),
                         "/etc/lighttpd/conf-enabled/")
MERGED_USR = ("/lib/", "/bin/", "/sbin/", "/lib64/")
# The receipt's "accounts" part hashes passwd and group; a role that adds a user or group changes them,
# and shadow, gshadow and the '-' copies change with them.
ACCOUNT_FILES = ("/etc/passwd", "/etc/group", "/etc/shadow", "/etc/gshadow")


def receipt_sees(path: str, watch: list[str]) -> bool:
    if any(path == w or path.startswith(w.rstrip("/") + "/") for w in watch):
        return True
    if path.removesuffix("-") in ACCOUNT_FILES:
        return True
    # A backup a module leaves beside a watched file when it changes it (fstab.<pid>.<date>~).
    return path.endswith("~") and any(path.startswith(w + ".") for w in watch)


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
