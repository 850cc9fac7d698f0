"""module_utils/mountinfo.py: the one parser of /proc/self/mountinfo and the one option rule, shared by
the fstab module, verify (MNT-001) and preflight."""

from __future__ import annotations

from ansible_collections.gptoss.host.plugins.module_utils import mountinfo

EXT4_BARRIER0 = "339 27 8:17 / /models rw,noatime shared:5 - ext4 /dev/sdb1 rw,barrier=0\n"
TWO_ON_ONE_POINT = ("40 27 0:50 / /models rw - tmpfs tmpfs rw\n"
                    "41 40 8:17 / /models rw,noatime - ext4 /dev/sdb1 rw,nobarrier\n")


def test_nobarrier_is_met_by_either_spelling_the_kernel_uses():
    mount = mountinfo.mount_at(EXT4_BARRIER0, "/models")
    assert mountinfo.missing_options(["defaults", "noatime", "nobarrier"], mount) == []
    assert mountinfo.missing_options(["nodiratime"], mount) == ["nodiratime"]


def test_the_mount_on_top_is_the_one_that_counts_and_a_trailing_slash_is_the_same_point():
    mount = mountinfo.mount_at(TWO_ON_ONE_POINT, "/models/")
    assert mount["fstype"] == "ext4" and mount["source"] == "/dev/sdb1"
    assert mountinfo.mount_at(TWO_ON_ONE_POINT, "/srv") is None


def test_this_machines_root_mount_is_found():
    with open(mountinfo.PROC_MOUNTINFO) as handle:
        text = handle.read()
    root = mountinfo.mount_at(text, "/")
    assert root is not None and root["fstype"]
    assert mountinfo.read_mount_at("/") == root
