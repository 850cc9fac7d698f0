"""The CPU frequency governor of every CPU: read it, set it, read it back. The one home of that rule.

Called by the ``gptoss.host.cpu_governor`` module (the role), by ``service.host.cpu_governor`` (the
boot unit gptoss-cpu-governor.service runs it at every boot) and read by verify (CPU-001), so
"what performance means on this cpufreq driver" is written once. Standard library only.
"""

from __future__ import annotations

import contextlib
from pathlib import Path


class GovernorError(RuntimeError):
    """A governor the driver does not offer, or a write that did not stick."""


CPU_ROOT = Path("/sys/devices/system/cpu")
# intel_pstate (active) and amd-pstate-epp offer only performance/powersave; acpi-cpufreq and
# amd-pstate (passive/guided) offer the classic set. The name is the same on all of them.
KNOWN_DRIVERS = {"intel_pstate", "intel_cpufreq", "acpi-cpufreq", "amd-pstate", "amd-pstate-epp", "cppc_cpufreq"}


def cpufreq_dirs(root: Path = CPU_ROOT) -> list[Path]:
    return sorted((p for p in root.glob("cpu[0-9]*/cpufreq") if (p / "scaling_governor").exists()),
                  key=lambda p: int(p.parent.name[3:]))


def read(path: Path) -> str:
    return path.read_text().strip() if path.exists() else ""


def state(root: Path = CPU_ROOT) -> dict:
    dirs = cpufreq_dirs(root)
    if not dirs:
        return {"supported": False, "reason": "no cpufreq in sysfs (VM or container): governor not supported",
                "cpus": {}}
    return {
        "supported": True,
        "driver": read(dirs[0] / "scaling_driver"),
        "cpus": {d.parent.name: {"governor": read(d / "scaling_governor"),
                                 "available": read(d / "scaling_available_governors").split(),
                                 "epp": read(d / "energy_performance_preference") or None}
                 for d in dirs},
    }


def apply(governor: str, check: bool, root: Path = CPU_ROOT) -> dict:
    before = state(root)
    result = {**before, "changed": False, "governor": governor, "set": []}
    if not before["supported"]:
        return result
    for cpu, info in before["cpus"].items():
        if info["available"] and governor not in info["available"]:
            raise GovernorError(f"{cpu}: governor {governor!r} not offered by {before['driver']} "
                             f"(available: {', '.join(info['available'])})")
        if info["governor"] != governor:
            result["set"].append(cpu)
            result["changed"] = True
            if not check:
                (root / cpu / "cpufreq/scaling_governor").write_text(governor)
        # With EPP drivers the "performance" governor already pins EPP; keep it explicit where writable.
        epp_file = root / cpu / "cpufreq/energy_performance_preference"
        if governor == "performance" and info["epp"] not in (None, "performance") and not check:
            # The performance governor may force EPP=performance and lock the file.
            with contextlib.suppress(OSError):
                epp_file.write_text("performance")
    after = state(root) if not check else before
    if not check:
        wrong = {cpu: i["governor"] for cpu, i in after["cpus"].items() if i["governor"] != governor}
        if wrong:
            raise GovernorError(f"governor did not stick on {wrong}")
        result["cpus"] = after["cpus"]
    return result
