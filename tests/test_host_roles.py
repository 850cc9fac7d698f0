"""Issue 3: host tuning roles against the real lab: files, mounts, units, refusals with nothing changed."""

from __future__ import annotations

import json

from conftest import ROOT, Lab


def test_model_mount_in_fstab_and_live(lab: Lab):
    fstab = lab.sh("cat /etc/fstab")
    line = next(line for line in fstab.splitlines() if " /models " in line)
    assert line.split()[3] == "defaults,noatime,nobarrier"
    assert fstab.count(" /models ") == 1
    live = next(line for line in lab.sh("cat /proc/self/mountinfo").splitlines() if line.split()[4] == "/models")
    per_mount, super_opts = line_options(live)
    assert "noatime" in per_mount and "nobarrier" in super_opts and " ext4 " in live
    # a timestamped backup of the previous fstab was kept
    assert lab.sh("ls /etc/ | grep -c '^fstab\\..*~$' || true").strip() != "0"


def line_options(mountinfo_line: str) -> tuple[list[str], list[str]]:
    before, _, after = mountinfo_line.partition(" - ")
    return before.split()[5].split(","), after.split()[2].split(",")


def shipped_code() -> set[str]:
    """What a host must hold under /opt/gptoss/lib/service: service/host and service/venv, never controller/."""
    return {f"/opt/gptoss/lib/{p.relative_to(ROOT)}" for p in
            [ROOT / "service" / "__init__.py", *(ROOT / "service" / "host").glob("*.py"),
             *(ROOT / "service" / "venv").glob("*.py")]}


def test_remount_is_repaired_by_a_converge(lab: Lab):
    lab.sh("mount -o remount,barrier /models")
    assert "nobarrier" not in lab.sh("grep ' /models ' /proc/self/mountinfo")
    # Stale code from an older layout (bench.py once lived in service/): the same play removes it.
    lab.sh("echo 'import aiohttp' > /opt/gptoss/lib/service/bench.py && echo x > /opt/gptoss/lib/service/host/old.py")
    result = lab.play("playbooks/host.yml", "--tags", "model_mount")
    assert result.rc == 0, result.output[-3000:]
    assert result.recap["changed"] >= 1
    assert "nobarrier" in lab.sh("grep ' /models ' /proc/self/mountinfo")
    on_host = set(lab.sh("find /opt/gptoss/lib/service -name '*.py' -type f").split())
    assert on_host == shipped_code()


def test_malformed_fstab_line_is_refused_and_left_as_is(lab: Lab):
    lab.sh("cp -p /etc/fstab /root/fstab.saved && echo 'broken-line-without-fields' >> /etc/fstab")
    try:
        before = lab.checksums("/etc/fstab")
        result = lab.play("playbooks/host.yml", "--tags", "model_mount",
                          extra_vars={"model_mount_options": ["defaults", "noatime"]})
        assert result.rc != 0
        assert "is malformed" in result.output and "fstab left untouched" in result.output
        assert lab.checksums("/etc/fstab") == before
    finally:
        lab.sh("cp -p /root/fstab.saved /etc/fstab")


def test_cpu_governor_reports_not_supported_and_installs_boot_unit(lab: Lab, converged):
    assert "cpu_governor: not supported on this machine" in converged.first.output
    assert lab.sh("systemctl is-enabled gptoss-cpu-governor.service").strip() == "enabled"
    status = lab.ssh("systemctl is-active gptoss-cpu-governor.service", check=False).stdout.strip()
    assert status == "active"
    shown = json.loads(lab.sh("PYTHONPATH=/opt/gptoss/lib python3 -m service.host.cpu_governor show"))
    assert shown["supported"] is False and "cpufreq" in shown["reason"]


def test_nccl_env_file_disables_p2p_without_nvml(lab: Lab):
    env = dict(line.split("=", 1) for line in lab.sh("grep -v '^#' /etc/gptoss/nccl.env").split())
    assert env == {"NCCL_IB_DISABLE": "1", "NCCL_P2P_DISABLE": "1", "TORCH_NCCL_ASYNC_ERROR_HANDLING": "1"}
    assert "NVML" in lab.sh("head -3 /etc/gptoss/nccl.env")


def test_nccl_env_extra_variables_reach_the_file(lab: Lab):
    result = lab.play("playbooks/host.yml", "--tags", "nccl_env", "--check", "--diff",
                      extra_vars={"nccl_env_extra": {"NCCL_DEBUG": "WARN"}})
    assert result.rc == 0, result.output[-3000:]
    assert "+NCCL_DEBUG=WARN" in result.output


def test_kernel_cmdline_dropin_and_reboot_required(lab: Lab, converged):
    dropin = lab.sh("cat /etc/default/grub.d/60-gptoss.cfg")
    assert 'nvidia.NVreg_EnableGpuFirmware=1 nvidia.NVreg_UsePageAttributeTable=1"' in dropin
    # The lab shares the controller's kernel: the flags can never be live there, so it must say so.
    assert "REBOOT REQUIRED" in converged.second.output
    # The drop-in is sourced by grub-mkconfig with the default file: it must be valid shell.
    lab.sh(". /etc/default/grub && . /etc/default/grub.d/60-gptoss.cfg && echo \"$GRUB_CMDLINE_LINUX\"")


def test_real_update_grub_put_the_flags_on_every_kernel_line_once(lab: Lab):
    """The handler ran the real update-grub inside the lab (its root is a zram block device)."""
    assert lab.state.root_zram_device, "lab root is not on zram: update-grub could not run there"
    linux_lines = [line for line in lab.sh("cat /boot/grub/grub.cfg").splitlines() if line.strip().startswith("linux")]
    assert linux_lines, "grub.cfg has no kernel entries"
    for line in linux_lines:
        for flag in ("nvidia.NVreg_EnableGpuFirmware=1", "nvidia.NVreg_UsePageAttributeTable=1"):
            assert line.split().count(flag) == 1, line


def test_grub_is_regenerated_with_a_backup_when_the_flags_change(lab: Lab):
    extra = {"kernel_cmdline_flags": ["nvidia.NVreg_EnableGpuFirmware=1", "nvidia.NVreg_UsePageAttributeTable=1",
                                      "nvidia.NVreg_PreserveVideoMemoryAllocations=1"]}
    try:
        result = lab.play("playbooks/host.yml", "--tags", "kernel_cmdline", extra_vars=extra)
        assert result.rc == 0, result.output[-3000:]
        assert "RUNNING HANDLER [kernel_cmdline : Regenerate the GRUB config]" in result.output
        assert "nvidia.NVreg_PreserveVideoMemoryAllocations=1" in lab.sh(r"grep -m1 '^\s*linux' /boot/grub/grub.cfg")
        backup = lab.sh("cat /boot/grub/grub.cfg.gptoss-bak")
        assert "PreserveVideoMemoryAllocations" not in backup and "NVreg_EnableGpuFirmware=1" in backup
    finally:
        restored = lab.play("playbooks/host.yml", "--tags", "kernel_cmdline")
        assert restored.rc == 0
    assert "PreserveVideoMemoryAllocations" not in lab.sh("cat /boot/grub/grub.cfg")


def test_kernel_cmdline_modprobe_alternative_in_check_mode(lab: Lab):
    result = lab.play("playbooks/host.yml", "--tags", "kernel_cmdline", "--check", "--diff",
                      extra_vars={"kernel_cmdline_method": "modprobe"})
    assert result.rc == 0, result.output[-3000:]
    assert "+options nvidia NVreg_EnableGpuFirmware=1 NVreg_UsePageAttributeTable=1" in result.output
    assert lab.checksums("/etc/modprobe.d/gptoss-nvidia.conf")["/etc/modprobe.d/gptoss-nvidia.conf"] == "absent"
