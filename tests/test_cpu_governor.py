"""module_utils/cpu_governor.py's set/readback logic on sysfs-shaped trees of real files, and the two
callers: the module gptoss.host.cpu_governor (the role) and service.host.cpu_governor (the boot unit).

No machine here has cpufreq (VMs and containers), so this is the only place the set path runs
before a real host: the layouts are those of intel_pstate (active, EPP) and acpi-cpufreq.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from ansible_collections.gptoss.host.plugins.module_utils import cpu_governor
from conftest import ROOT, run_ansible_module

INTEL_PSTATE = {"driver": "intel_pstate", "available": "performance powersave", "governor": "powersave",
                "epp": "balance_power"}
ACPI_CPUFREQ = {"driver": "acpi-cpufreq", "governor": "schedutil",
                "available": "conservative ondemand userspace powersave performance schedutil"}


def make_tree(root: Path, cpus: int, layout: dict[str, str]) -> Path:
    for n in range(cpus):
        d = root / f"cpu{n}" / "cpufreq"
        d.mkdir(parents=True)
        (d / "scaling_driver").write_text(layout["driver"] + "\n")
        (d / "scaling_governor").write_text(layout["governor"] + "\n")
        (d / "scaling_available_governors").write_text(layout["available"] + "\n")
        if "epp" in layout:
            (d / "energy_performance_preference").write_text(layout["epp"] + "\n")
    (root / "cpufreq").mkdir()  # the policy folder next to cpuN is not a CPU
    return root


def governors(root: Path) -> list[str]:
    return [(p / "scaling_governor").read_text().strip() for p in cpu_governor.cpufreq_dirs(root)]


@pytest.mark.parametrize("layout", [INTEL_PSTATE, ACPI_CPUFREQ], ids=["intel_pstate", "acpi-cpufreq"])
def test_set_performance_on_every_cpu_and_read_it_back(tmp_path: Path, layout: dict[str, str]) -> None:
    root = make_tree(tmp_path, 12, layout)  # cpu10 and cpu11 sort after cpu9, not after cpu1
    result = cpu_governor.apply("performance", check=False, root=root)
    assert result["changed"] is True and result["driver"] == layout["driver"]
    assert result["set"] == [f"cpu{n}" for n in range(12)]
    assert governors(root) == ["performance"] * 12
    if "epp" in layout:
        assert {(root / f"cpu{n}/cpufreq/energy_performance_preference").read_text() for n in range(12)} == {
            "performance"}
    again = cpu_governor.apply("performance", check=False, root=root)
    assert again["changed"] is False and again["set"] == []


def test_check_mode_reports_and_writes_nothing(tmp_path: Path) -> None:
    root = make_tree(tmp_path, 4, ACPI_CPUFREQ)
    result = cpu_governor.apply("performance", check=True, root=root)
    assert result["changed"] is True and result["set"] == ["cpu0", "cpu1", "cpu2", "cpu3"]
    assert governors(root) == ["schedutil"] * 4


def test_governor_the_driver_does_not_offer_is_refused_before_any_write(tmp_path: Path) -> None:
    root = make_tree(tmp_path, 4, INTEL_PSTATE)
    with pytest.raises(cpu_governor.GovernorError, match="governor 'schedutil' not offered by intel_pstate"):
        cpu_governor.apply("schedutil", check=False, root=root)
    assert governors(root) == ["powersave"] * 4


def test_a_write_that_does_not_stick_is_an_error(tmp_path: Path) -> None:
    root = make_tree(tmp_path, 2, ACPI_CPUFREQ)
    sticky = root / "cpu1/cpufreq/scaling_governor"
    sticky.unlink()
    os.symlink("/dev/null", sticky)  # takes the write, reads back empty: like a driver that ignores it
    with pytest.raises(cpu_governor.GovernorError, match="governor did not stick on"):
        cpu_governor.apply("performance", check=False, root=root)


def test_no_cpufreq_is_reported_not_supported(tmp_path: Path) -> None:
    (tmp_path / "cpu0").mkdir()
    result = cpu_governor.apply("performance", check=False, root=tmp_path)
    assert result["supported"] is False and result["changed"] is False and "not supported" in result["reason"]


def test_the_module_and_the_boot_units_command_line_on_this_machine_without_cpufreq() -> None:
    if cpu_governor.cpufreq_dirs():
        pytest.skip("this machine has cpufreq")
    result = run_ansible_module("cpu_governor", {"governor": "performance"}, "--check", "--diff")
    assert not result["failed"] and result["changed"] is False and result["supported"] is False
    assert "not supported" in result["reason"]
    # What gptoss-cpu-governor.service runs at boot (PYTHONPATH as the unit sets it: the collection's
    # module_utils next to service/, here the repository's own).
    env = {**os.environ, "PYTHONPATH": f"{ROOT}:{ROOT / 'collections'}"}
    proc = subprocess.run([sys.executable, "-m", "service.host.cpu_governor", "set", "performance"],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout)["supported"] is False
