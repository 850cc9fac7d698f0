"""The driver-candidate rule (module_utils apt_policy / debian_version) on real apt output, and the
apt_candidate module run for real on this controller's apt (read-only, check mode)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "collections"))

from ansible_collections.gptoss.host.plugins.module_utils import apt_policy  # noqa: E402
from ansible_collections.gptoss.host.plugins.module_utils.debian_version import (  # noqa: E402
    compare_versions,
    driver_at_least,
    split_version,
    upstream_version,
)

DATA = ROOT / "tests" / "data" / "apt"
NVIDIA_URL = "https://developer.download.nvidia.com/compute/cuda/repos/debian12/x86_64/"

# Pairs that exercise every dpkg rule: epochs, revisions, '~' before everything, letters before
# other symbols, numeric runs with leading zeros, and the driver versions this project meets.
VERSION_PAIRS = [
    ("580.95.05-1", "580.65.06"), ("535.261.03-1", "580.65.06"), ("580.65.06", "580.65.06-1"),
    ("1:535.0-1", "580.95.05-1"), ("580.95.05-0ubuntu0.24.04.1", "580.95.05-1"),
    ("1.0~rc1", "1.0"), ("1.0~rc1", "1.0~rc2"), ("1.0~", "1.0"), ("1.0a", "1.0"), ("1.0+b1", "1.0a"),
    ("1.01", "1.1"), ("1.10", "1.9"), ("2.6.1", "2.6.1"), ("1.2-3-4", "1.2-3-5"), ("0:1.0", "1.0"),
    ("535.247.01-1~deb12u1", "535.247.01-1"), ("590.48.01-1", "580.173.02-1"), ("1.0-1", "1.0"),
]


@pytest.mark.skipif(shutil.which("dpkg") is None, reason="needs dpkg to compare against")
@pytest.mark.parametrize(("left", "right"), VERSION_PAIRS)
def test_compare_versions_agrees_with_dpkg(left: str, right: str):
    def dpkg_says(op: str) -> bool:
        return subprocess.run(["dpkg", "--compare-versions", left, op, right]).returncode == 0
    expected = -1 if dpkg_says("lt") else (1 if dpkg_says("gt") else 0)
    assert compare_versions(left, right) == expected
    assert compare_versions(right, left) == -expected


@pytest.mark.parametrize("bad", ["", "abc", "1.0 2", "a:1.0", "2:", "1.0-", ":1.0"])
def test_split_version_refuses_what_is_not_a_debian_version(bad: str):
    with pytest.raises(ValueError, match="not a Debian version"):
        split_version(bad)


def test_driver_version_is_the_upstream_part():
    assert upstream_version("1:580.95.05-0ubuntu0.24.04.1") == "580.95.05"
    assert driver_at_least("580.65.06-1", "580.65.06")
    assert not driver_at_least("580.65.05-9", "580.65.06")
    assert not driver_at_least("2:535.261.03-1", "580.65.06")  # an epoch does not make a driver newer


def read(name: str) -> str:
    return (DATA / name).read_text()


def test_parse_policy_of_the_bookworm_archive():
    policies = apt_policy.parse_policy(read("bookworm-policy-driver.txt"))
    # The NVIDIA-repository package names are unknown to the Debian archive: apt prints nothing.
    assert set(policies) == {"nvidia-driver", "nvidia-open-kernel-dkms", "firmware-misc-nonfree"}
    driver = policies["nvidia-driver"]
    assert driver.installed is None and driver.candidate.startswith("535.")
    assert [o.version for o in driver.offers] == [driver.candidate]
    assert driver.offers[0].priority == 500 and "bookworm/non-free" in driver.offers[0].sources[0]


def test_parse_policy_marks_the_installed_version():
    apt = apt_policy.parse_policy(read("bookworm-policy-installed.txt"))["apt"]
    assert apt.installed == apt.candidate and apt.offers[0].installed
    assert apt.offers[0].sources == [s for s in apt.offers[0].sources if "dpkg/status" not in s]


def test_archive_driver_is_refused_with_its_candidate_the_requirement_and_the_fix():
    decision = apt_policy.decide(apt_policy.parse_policy(read("bookworm-policy-driver.txt")),
                                 ["nvidia-driver", "nvidia-open-kernel-dkms"], "580.65.06",
                                 label="nvidia_driver", fix="set nvidia_driver_source: nvidia")
    assert not decision.ok
    candidate = apt_policy.parse_policy(read("bookworm-policy-driver.txt"))["nvidia-driver"].candidate
    assert f"nvidia-driver: apt's candidate is {candidate}" in decision.message
    assert "below 580.65.06" in decision.message and "nothing was installed" in decision.message
    assert decision.message.endswith("Fix: set nvidia_driver_source: nvidia")


def test_unreachable_nvidia_repository_is_named_with_apts_reason():
    package_files = apt_policy.parse_package_files(read("bookworm-package-files.txt"))
    failures = apt_policy.parse_update_failures(read("bookworm-update-nvidia-unreachable.txt"))
    assert failures and failures[0][0].startswith(NVIDIA_URL)
    decision = apt_policy.decide(apt_policy.parse_policy(read("bookworm-policy-driver.txt")),
                                 ["nvidia-driver-cuda", "nvidia-kernel-open-dkms"], "580.65.06",
                                 [NVIDIA_URL], package_files, failures, "nvidia_driver")
    assert not decision.ok
    assert "nvidia-driver-cuda: no configured apt source offers it" in decision.message
    assert decision.unreadable_sources == [{"url": NVIDIA_URL, "reason": failures[0][1]}]
    assert f"the repository {NVIDIA_URL} could not be read: Could not resolve" in decision.message
    # A source whose lists apt has is not reported as unreadable.
    archive = package_files[0].split()[0]
    assert apt_policy.unreadable_sources([archive + "/"], package_files, failures) == []


def test_untrusted_sources_are_named_too():
    # apt 2.6's lines for a repository signed by a key the keyring lacks, and for an unsigned one.
    text = ("W: GPG error: https://mirror.example/cuda/debian12/x86_64  InRelease: The following signatures "
            "couldn't be verified because the public key is not available: NO_PUBKEY A4B469963BF863CC\n"
            "E: The repository 'https://mirror.example/cuda/debian12/x86_64  InRelease' is not signed.\n")
    failures = apt_policy.parse_update_failures(text)
    assert [url for url, _ in failures] == ["https://mirror.example/cuda/debian12/x86_64"] * 2
    assert "NO_PUBKEY A4B469963BF863CC" in failures[0][1] and failures[1][1] == "is not signed."
    unreadable = apt_policy.unreadable_sources(["https://mirror.example/cuda/debian12/x86_64/"], [], failures)
    assert "NO_PUBKEY" in unreadable[0]["reason"]


# apt-cache policy in the format apt 2.6 prints, for a host where NVIDIA's repository is readable
# (it cannot be reached from the lab): the pinned branch is the candidate, a newer branch is not.
NVIDIA_POLICY = """\
nvidia-driver-cuda:
  Installed: (none)
  Candidate: 580.95.05-1
  Version table:
     590.48.01-1 500
        500 https://developer.download.nvidia.com/compute/cuda/repos/debian12/x86_64  Packages
     580.95.05-1 900
        500 https://developer.download.nvidia.com/compute/cuda/repos/debian12/x86_64  Packages
     580.65.06-1 900
        500 https://developer.download.nvidia.com/compute/cuda/repos/debian12/x86_64  Packages
"""


def test_readable_repository_with_the_branch_is_accepted():
    decision = apt_policy.decide(apt_policy.parse_policy(NVIDIA_POLICY), ["nvidia-driver-cuda"], "580.65.06")
    assert decision.ok and decision.packages[0].candidate == "580.95.05-1"
    assert decision.packages[0].best_offer == "590.48.01-1"  # the highest offer, whatever the pin says


def test_a_pin_that_prefers_an_older_driver_is_explained():
    pinned_low = NVIDIA_POLICY.replace("Candidate: 580.95.05-1", "Candidate: 535.261.03-1") + (
        "     535.261.03-1 990\n        500 http://debian-mirror.example/debian bookworm/non-free amd64 Packages\n")
    decision = apt_policy.decide(apt_policy.parse_policy(pinned_low), ["nvidia-driver-cuda"], "580.65.06")
    assert not decision.ok
    assert "although https://developer.download.nvidia.com" in decision.message
    assert "offers 590.48.01-1: an apt pin or priority prefers the older one" in decision.message


@pytest.mark.parametrize(("installed", "loaded", "expected"), [
    ("580.95.05-1", "", {"installed_meets": True, "loaded_meets": False, "reboot_required": True}),
    ("580.95.05-1", "535.261.03", {"installed_meets": True, "loaded_meets": False, "reboot_required": True}),
    ("580.95.05-1", "580.95.05", {"installed_meets": True, "loaded_meets": True, "reboot_required": False}),
    (None, "", {"installed_meets": False, "loaded_meets": False, "reboot_required": False}),
])
def test_reboot_required_until_the_loaded_module_has_the_required_version(installed, loaded, expected):
    assert apt_policy.driver_status(installed, loaded or None, "580.65.06") == expected


def run_module(args: dict, tmp_path: Path, check: bool = True) -> tuple[int, dict]:
    """The real module, run the way Ansible runs it (arguments file, JSON out), on this controller's apt."""
    args_file = tmp_path / "args.json"
    args_file.write_text(json.dumps({"ANSIBLE_MODULE_ARGS": {**args, "_ansible_check_mode": check}}))
    module = ROOT / "collections/ansible_collections/gptoss/host/plugins/modules/apt_candidate.py"
    env = {**os.environ, "PYTHONPATH": str(ROOT / "collections")}
    proc = subprocess.run([str(ROOT / ".venv/bin/python"), str(module), str(args_file)], env=env,
                          capture_output=True, text=True, timeout=120)
    return proc.returncode, json.loads(proc.stdout)


@pytest.mark.skipif(shutil.which("apt-cache") is None, reason="needs apt on the controller")
def test_module_reads_the_real_candidate_and_refuses_above_it(tmp_path: Path):
    installed = subprocess.run(["dpkg-query", "-W", "-f=${Version}", "apt"], capture_output=True,
                               text=True, check=True).stdout
    rc, ok = run_module({"packages": ["apt"], "required": upstream_version(installed), "refresh": True}, tmp_path)
    assert rc == 0 and ok["ok"] and ok["packages"][0]["installed"] == installed
    assert ok["refreshed"] is False  # check mode never runs apt-get update
    assert ok["changed"] is False
    rc, refused = run_module({"packages": ["apt"], "required": "999.0", "label": "t", "fix": "raise it"}, tmp_path)
    assert rc != 0 and refused["failed"]
    assert refused["msg"].startswith("t: refusing to install") and refused["msg"].endswith("Fix: raise it")
    assert "below 999.0" in refused["msg"]
