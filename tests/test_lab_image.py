"""A lab started from another lab's image (lab/nspawn.py save_image / up_from_image): how the suite's
cloned groups get their converged labs (tests/conftest.py). The copy must be the same disks with an
identity of its own, and must not start the copied services on its first boot: labs share this machine's
network, so a copied server would listen on the origin's address."""

from __future__ import annotations

import os
import shutil
from collections.abc import Iterator

import pytest
from conftest import LAB_NAME, Lab

from lab import nspawn

# A service the origin enabled: on the copy's first boot it must stay down.
COPIED_UNIT = "gptoss-test-copied.service"


@pytest.fixture(scope="module")
def origin_and_copy(lab_assets) -> Iterator[tuple[Lab, Lab]]:
    names = (f"{LAB_NAME}-image-src", f"{LAB_NAME}-image-copy")
    for name in names:
        if nspawn.load_state(name) is not None:
            nspawn.down(name)
    image = nspawn.CACHE_DIR / f"lab-image-test-{os.getpid()}"
    try:
        state, _ = nspawn.up(names[0])
        origin = Lab(state)
        origin.sh(f"printf '[Service]\\nExecStart=/bin/sleep infinity\\n[Install]\\nWantedBy=multi-user.target\\n'"
                  f" > /etc/systemd/system/{COPIED_UNIT} && systemctl enable --now {COPIED_UNIT}"
                  " && mkdir -p /opt/copied && echo payload > /opt/copied/file && mkfs.ext4 -q -F"
                  f" {state.loop_device} && mount {state.loop_device} /models && echo weights > /models/w && sync")
        nspawn.save_image(names[0], image)
        copy_state, what = nspawn.up_from_image(names[1], image)
        assert "from the image of" in what
        yield origin, Lab(copy_state)
    finally:
        if os.environ.get("GPTOSS_KEEP_LAB") != "1":
            for name in names:
                nspawn.down(name)
        shutil.rmtree(image, ignore_errors=True)


def test_the_copy_has_the_origins_files_and_model_disk(origin_and_copy):
    _, copy = origin_and_copy
    assert copy.sh("cat /opt/copied/file").strip() == "payload"
    copy.sh(f"mount {copy.state.loop_device} /mnt")
    try:
        assert copy.sh("cat /mnt/w").strip() == "weights"
    finally:
        copy.ssh("umount /mnt", check=False)


def test_the_copy_has_an_identity_of_its_own(origin_and_copy):
    origin, copy = origin_and_copy
    assert (copy.state.address, copy.state.ssh_port) != (origin.state.address, origin.state.ssh_port)
    assert copy.sh("hostname").strip() == copy.state.machine_name != origin.sh("hostname").strip()
    assert copy.sh("cat /etc/machine-id") != origin.sh("cat /etc/machine-id")
    host_key = "ssh-keygen -lf /etc/ssh/ssh_host_ed25519_key.pub"
    assert copy.sh(host_key).split()[1] != origin.sh(host_key).split()[1]
    assert copy.state.key_file.read_text() != origin.state.key_file.read_text()  # its own login key


def test_the_copied_services_start_only_after_a_normal_boot(origin_and_copy):
    _, copy = origin_and_copy
    assert copy.ssh(f"systemctl is-active {COPIED_UNIT}", check=False).stdout.strip() == "inactive"
    assert copy.ssh("systemctl is-active multi-user.target", check=False).stdout.strip() == "inactive"
    nspawn.restart(copy.state.name)  # a reboot of the copy is a normal boot
    assert copy.sh(f"systemctl is-active {COPIED_UNIT} multi-user.target").split() == ["active", "active"]
