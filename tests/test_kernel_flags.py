"""module_utils/kernel_flags.py, the one rule for "are the kernel/driver flags live", and the module
gptoss.host.kernel_flags_live that the kernel_cmdline role asks (through ansible, on this machine)."""

from __future__ import annotations

from pathlib import Path

import pytest
from ansible_collections.gptoss.host.plugins.module_utils import kernel_flags
from conftest import run_ansible_module

H200_PARAMS = kernel_flags.parse_driver_params(
    (Path(__file__).parent / "data" / "h200" / "proc.txt").read_text())


def test_modprobe_compares_enable_gpu_firmware_by_its_mode_bits():
    # The H200's driver shows EnableGpuFirmware: 18 = 0x12: policy 0x10 (fallback allowed), mode 2.
    assert H200_PARAMS["EnableGpuFirmware"] == "18"
    assert kernel_flags.flag_problems("modprobe", ["nvidia.NVreg_EnableGpuFirmware=2"], "", H200_PARAMS) == {}
    wrong = kernel_flags.flag_problems("modprobe", ["nvidia.NVreg_EnableGpuFirmware=0"], "", H200_PARAMS)
    assert wrong == {"nvidia.NVreg_EnableGpuFirmware=0": "18 = mode 2 (default policy), want mode 0"}


def test_modprobe_reads_numbers_as_numbers_and_unset_as_not_applied():
    params = {"DynamicPowerManagement": "0x03", "UsePageAttributeTable": "4294967295", "RegistryDwords": '""'}
    flags = ["nvidia.NVreg_DynamicPowerManagement=3", "nvidia.NVreg_UsePageAttributeTable=1",
             "nvidia.NVreg_NoSuchParameter=1", "pci=noaer"]
    wrong = kernel_flags.flag_problems("modprobe", flags, "", params)
    assert list(wrong) == flags[1:]
    assert "unset" in wrong[flags[1]] and wrong[flags[2]] == "not in params"
    assert "cannot apply" in wrong["pci=noaer"]
    assert kernel_flags.flag_problems("modprobe", flags[:1], "", None) == {flags[0]: "driver not loaded"}


def test_grub_reads_the_command_line_and_a_later_word_wins():
    cmdline = "BOOT_IMAGE=/vmlinuz root=/dev/sda1 nvidia.NVreg_EnableGpuFirmware=1 quiet " \
              "nvidia.NVreg_EnableGpuFirmware=0\n"
    assert kernel_flags.flag_problems("grub", ["nvidia.NVreg_EnableGpuFirmware=0", "quiet="], cmdline, None) == {}
    wrong = kernel_flags.flag_problems("grub", ["nvidia.NVreg_EnableGpuFirmware=1", "pci=noaer"], cmdline, None)
    assert wrong == {"nvidia.NVreg_EnableGpuFirmware=1": "'0' (want '1')", "pci=noaer": "absent"}


def test_an_unknown_method_is_refused():
    with pytest.raises(ValueError, match="want one of grub, modprobe"):
        kernel_flags.flag_problems("sysfs", [], "", None)


def test_the_module_reads_this_machines_proc_cmdline():
    live = next(word for word in Path("/proc/cmdline").read_text().split() if "=" in word)
    result = run_ansible_module("kernel_flags_live", {"method": "grub",
                                                      "flags": [live, "nvidia.NVreg_EnableGpuFirmware=0"]}, "--check")
    assert not result["failed"] and result["changed"] is False
    assert result["pending"] == ["nvidia.NVreg_EnableGpuFirmware=0"] and result["read_from"] == "/proc/cmdline"


def test_the_module_without_a_driver_calls_driver_flags_pending():
    if Path(kernel_flags.PROC_PARAMS).exists():
        pytest.skip("an NVIDIA driver is loaded here")
    result = run_ansible_module("kernel_flags_live", {"method": "modprobe",
                                                      "flags": ["nvidia.NVreg_EnableGpuFirmware=0"]})
    assert result["pending"] == ["nvidia.NVreg_EnableGpuFirmware=0"]
    assert result["read_from"] == "no NVIDIA driver loaded"
    assert result["reasons"] == {"nvidia.NVreg_EnableGpuFirmware=0": "driver not loaded"}
