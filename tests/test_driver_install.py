"""Issue 12: the nvidia_driver install path in the lab, against the real Debian archive its apt uses.

The lab has no GPU; `nvidia_driver_skip_gpu_check` (lab/test only) skips the GPU-presence test and
nothing else, so the role walks the real decision: source, plan, apt's real candidate, refusal.
Only the nvidia_driver role runs (playbooks/host.yml --tags nvidia_driver) on the session's fresh
lab; no converge is needed. Every test leaves apt's configuration and package lists as it found them.
"""

from __future__ import annotations

import hashlib
import os
import re
import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
from conftest import Lab, record_timing

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "collections"))
from ansible_collections.gptoss.host.plugins.module_utils.version_chain import minimum_driver_for_cuda  # noqa: E402

CUDA = "13.0"
SOURCE_FILE = "/etc/apt/sources.list.d/gptoss-nvidia-cuda.sources"
PIN_FILE = "/etc/apt/preferences.d/gptoss-nvidia-driver.pref"
KEYRING = "/etc/apt/keyrings/gptoss-nvidia-cuda.asc"
ROLE_FILES = [SOURCE_FILE, PIN_FILE, KEYRING]
# The Debian archive's driver branch per release (bookworm 535, trixie 550): both below R580.
ARCHIVE_DRIVER_BRANCH = {"12": "535", "13": "550"}
# dpkg's state: the status database, every package's version and selection, and the holds.
DPKG_STATE = ("sha256sum /var/lib/dpkg/status; dpkg-query -W -f='${Package} ${Version} ${Status}\\n' | sha256sum; "
              "apt-mark showhold")


@pytest.fixture
def apt_restored(request) -> Iterator[Lab]:
    """Keep the lab's package lists and remove what the role adds, so other tests see the lab as it was.
    Parametrized indirectly with a Debian release (default bookworm, the session lab); the trixie lab
    is used once its own converge ran, so its fresh-host checks saw it untouched."""
    if getattr(request, "param", "bookworm") == "trixie":
        request.getfixturevalue("trixie_converged")
        lab = request.getfixturevalue("trixie_lab")
    else:
        lab = request.getfixturevalue("fresh_lab")
    lab.sh("rm -rf /root/apt-lists.saved && cp -a /var/lib/apt/lists /root/apt-lists.saved")
    before = lab.checksums(*ROLE_FILES)
    try:
        yield lab
    finally:
        lab.sh(f"rm -f {' '.join(ROLE_FILES)} && rm -rf /var/lib/apt/lists && mv /root/apt-lists.saved "
               "/var/lib/apt/lists && rm -f /var/cache/apt/pkgcache.bin /var/cache/apt/srcpkgcache.bin")
        assert lab.checksums(*ROLE_FILES) == before
        lab.sh("apt-cache policy >/dev/null")  # apt still reads its configuration


def walk_the_install(lab: Lab, *args: str, **extra):
    return lab.play("playbooks/host.yml", "--tags", "nvidia_driver", *args,
                    extra_vars={"nvidia_driver_skip_gpu_check": True, "nvidia_driver_cuda_version": CUDA, **extra})


@pytest.mark.parametrize("apt_restored", ["bookworm", "trixie"], indirect=True)
def test_archive_driver_is_refused_before_anything_is_installed(apt_restored: Lab):
    lab = apt_restored
    required = minimum_driver_for_cuda(CUDA)
    dpkg_before = lab.sh(DPKG_STATE)
    result = walk_the_install(lab, nvidia_driver_source="archive")
    record_timing(f"driver_archive_refusal_{lab.state.release}", result.seconds)
    assert result.rc != 0, result.output[-3000:]
    assert "GPU-presence test skipped" in result.output
    # The archive's real candidate, read the same way apt would install it. The role read it with
    # private package lists (validate first leaves the host's alone), so the host's lists are brought
    # up to date here first (apt_restored puts them back afterwards).
    candidate = re.search(r"Candidate: (\S+)", lab.sh("apt-get update -qq >/dev/null 2>&1; "
                                                       "LC_ALL=C apt-cache policy nvidia-driver")).group(1)
    release = lab.sh(". /etc/os-release && echo $VERSION_ID").strip()
    archive_branch = ARCHIVE_DRIVER_BRANCH[release]
    assert candidate.startswith(archive_branch + "."), f"Debian {release}'s driver is {archive_branch}: {candidate}"
    assert f"nvidia-driver: apt's candidate is {candidate}" in result.output
    assert f"below {required}" in result.output and "nothing was installed" in result.output
    assert "Fix: the Debian archive has no driver at or above" in result.output
    assert "Set nvidia_driver_source: nvidia" in result.output
    assert "TASK [nvidia_driver : Install the driver packages]" not in result.output
    assert lab.sh(DPKG_STATE) == dpkg_before


def throwaway_test_key(directory: Path) -> Path:
    """A fresh signing key that signs nothing: it only proves the keyring travels from the controller."""
    home = directory / "gnupg"
    home.mkdir(mode=0o700)
    env = {**os.environ, "GNUPGHOME": str(home)}
    subprocess.run(["gpg", "--batch", "--pinentry-mode", "loopback", "--passphrase", "", "--quick-gen-key",
                    "gptoss TEST ONLY throwaway key (never trust) <test-only@gptoss.invalid>", "ed25519", "sign",
                    "1d"], env=env, check=True, capture_output=True)
    key = directory / "gptoss-TEST-ONLY-throwaway-key.asc"
    key.write_bytes(subprocess.run(["gpg", "--armor", "--export"], env=env, check=True,
                                   capture_output=True).stdout)
    return key


@pytest.mark.skipif(shutil.which("gpg") is None, reason="needs gpg on the controller for the throwaway key")
def test_nvidia_repository_is_configured_and_its_absence_refused(apt_restored: Lab, tmp_path: Path):
    lab = apt_restored
    required = minimum_driver_for_cuda(CUDA)
    branch = required.split(".")[0]
    release = lab.sh(". /etc/os-release && echo $VERSION_ID").strip()
    url = f"https://developer.download.nvidia.com/compute/cuda/repos/debian{release}/x86_64/"
    key = throwaway_test_key(tmp_path)
    dpkg_before = lab.sh(DPKG_STATE)
    files_before = lab.checksums(*ROLE_FILES)

    # --check --diff: shows the source, key and pin it would write, writes nothing, refuses nothing
    # (apt cannot read a repository that is not configured yet), installs nothing.
    check = walk_the_install(lab, "--check", "--diff", nvidia_driver_repo_keyring_src=str(key))
    assert check.rc == 0, check.output[-3000:]
    assert f"+URIs: {url}" in check.output and f"+Signed-By: {KEYRING}" in check.output
    assert lab.checksums(*ROLE_FILES) == files_before

    result = walk_the_install(lab, nvidia_driver_repo_keyring_src=str(key))
    record_timing("driver_nvidia_repo_refusal", result.seconds)
    assert result.rc != 0, result.output[-3000:]
    # The plan: NVIDIA's compute-only packages with the open kernel modules, on the required branch.
    assert f"nvidia_driver plan: source nvidia, branch {branch} (required {required})" in result.output
    assert re.search(r"packages\s+nvidia-driver-cuda\s+nvidia-kernel-open-dkms\s+linux-headers-", result.output)
    # What was written: a deb822 source signed by the controller's key only, and the branch pin.
    source = lab.sh(f"cat {SOURCE_FILE}")
    assert f"URIs: {url}\nSuites: /\nSigned-By: {KEYRING}\n" in source
    assert lab.checksums(KEYRING)[KEYRING] == hashlib.sha256(key.read_bytes()).hexdigest()
    assert f"Pin: version /^([0-9]+:)?{branch}\\./" in lab.sh(f"cat {PIN_FILE}")
    # NVIDIA's repository cannot be reached from the lab: the role says so, and refuses.
    assert f"the repository {url} could not be read:" in result.output
    assert "nvidia-driver-cuda: no configured apt source offers it" in result.output
    assert "TASK [nvidia_driver : Install the driver packages]" not in result.output
    assert lab.sh(DPKG_STATE) == dpkg_before

    # A second run changes nothing (it refuses again, from the lists it already has).
    again = walk_the_install(lab, "--check", "--diff", nvidia_driver_repo_keyring_src=str(key))
    assert again.rc != 0 and again.recap["changed"] == 0, again.output[-3000:]
    assert lab.sh(DPKG_STATE) == dpkg_before
