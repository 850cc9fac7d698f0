"""NVIDIA driver facts from /proc and NVML (runs on the host, stdlib only; pynvml is optional).

``python3 -m service.host.nvidia --json`` prints ``nvml_snapshot()``; the nvidia_driver and nccl_env roles
call it on the host so there is one reading of "what driver / GPUs / P2P does this box have".
"""

from __future__ import annotations

import argparse
import contextlib
import json
import re
import sys
from pathlib import Path
from typing import Any

from ansible_collections.gptoss.host.plugins.module_utils import kernel_flags, version_chain

from service.host import nvml_reader

PROC_VERSION = Path("/proc/driver/nvidia/version")
PROC_PARAMS = Path(kernel_flags.PROC_PARAMS)
# The project's absolute floor (R535 LTS); the CUDA build usually needs more.
PROJECT_DRIVER_FLOOR = "535"

# nvmlGpuP2PStatus_t values (nvml.h); 0 means the pair can do P2P reads.
P2P_STATUS_NAMES = {
    0: "ok",
    1: "chipset_not_supported",
    2: "gpu_not_supported",
    3: "ioh_topology_not_supported",
    4: "disabled_by_regkey",
    5: "not_supported",
    6: "unknown",
}
UNSUPPORTED = nvml_reader.UNSUPPORTED

_VERSION_RE = re.compile(r"NVRM version:\s*(?P<desc>.*?Kernel Module.*?)\s+(?P<ver>\d+\.\d+(?:\.\d+)?)\b")


def parse_proc_version(text: str) -> dict[str, str]:
    """Driver version and kernel module flavour from /proc/driver/nvidia/version text.

    Open module:        'NVRM version: NVIDIA UNIX Open Kernel Module for x86_64  580.159.04  Release Build ...'
    Proprietary module: 'NVRM version: NVIDIA UNIX x86_64 Kernel Module  535.104.05  Sat Aug 19 ...'
    """
    match = _VERSION_RE.search(text)
    if not match:
        raise ValueError("no 'NVRM version: ... Kernel Module ... <version>' line")
    kernel_module = "open" if "Open Kernel Module" in match.group("desc") else "proprietary"
    return {"driver_version": match.group("ver"), "kernel_module": kernel_module}


def parse_proc_params(text: str) -> dict[str, str]:
    """'Name: value' lines of /proc/driver/nvidia/params -> {Name: value} (module_utils.kernel_flags parses)."""
    return kernel_flags.parse_driver_params(text)


def read_proc_driver(version_path: Path = PROC_VERSION, params_path: Path = PROC_PARAMS) -> dict[str, Any]:
    """Both /proc files; {'loaded': False, 'reason': ...} when the kernel module is not loaded."""
    try:
        version_text = version_path.read_text()
    except OSError as err:
        return {"loaded": False, "reason": f"{version_path}: {err.strerror or err} (driver not loaded)"}
    info: dict[str, Any] = {"loaded": True, **parse_proc_version(version_text)}
    try:
        info["params"] = parse_proc_params(params_path.read_text())
    except OSError as err:
        info["params"] = None
        info["params_reason"] = f"{params_path}: {err.strerror or err}"
    return info


def cuda_driver_version_text(value: int) -> str:
    """nvmlSystemGetCudaDriverVersion's integer (13000) -> '13.0'."""
    return f"{value // 1000}.{(value % 1000) // 10}"


# What verify and the roles read of each GPU, through the one reader (nvml_reader.FIELDS).
GPU_FACT_FIELDS = ("name", "uuid", "pci_bus_id", "persistence_mode", "pcie_gen_current", "pcie_gen_max",
                   "pcie_width_current", "pcie_width_max", "memory_total_bytes", "gsp_firmware_mode",
                   "gsp_firmware_version")


def _gpu_facts(pynvml: Any, index: int, handle: Any) -> dict[str, Any]:
    return {"index": index, **nvml_reader.read_fields(pynvml, handle, GPU_FACT_FIELDS)}


def _p2p_pairs(pynvml: Any, handles: list[Any]) -> list[dict[str, Any]]:
    pairs = []
    for a in range(len(handles)):
        for b in range(a + 1, len(handles)):
            # Caps index 0 (READ) as a literal: pynvml's NVML_P2P_CAPS_INDEX_READ is a tuple in some versions.
            code = nvml_reader.call(pynvml, "nvmlDeviceGetP2PStatus", handles[a], handles[b], 0)
            status = P2P_STATUS_NAMES.get(code, f"code {code}") if isinstance(code, int) else code
            pairs.append({"a": a, "b": b, "status": status, "code": code if isinstance(code, int) else None})
    return pairs


def nvml_snapshot() -> dict[str, Any]:
    """Driver, CUDA driver API version, per-GPU facts and P2P status per pair, read through NVML."""
    pynvml, why = nvml_reader.load()  # optional: nvidia-ml-py
    if pynvml is None:
        return {"available": False, "reason": why, "reason_code": nvml_reader.REASON_PYNVML_MISSING}
    try:
        pynvml.nvmlInit()
    except pynvml.NVMLError as err:
        return {"available": False, "reason": f"nvmlInit failed: {err}",
                "reason_code": nvml_reader.failure_reason(err)}
    try:
        cuda = nvml_reader.call(pynvml, "nvmlSystemGetCudaDriverVersion")
        count = nvml_reader.call(pynvml, "nvmlDeviceGetCount")
        handles = [pynvml.nvmlDeviceGetHandleByIndex(i) for i in range(count if isinstance(count, int) else 0)]
        return {
            "available": True,
            "driver_version": nvml_reader.call(pynvml, "nvmlSystemGetDriverVersion"),
            "nvml_version": nvml_reader.call(pynvml, "nvmlSystemGetNVMLVersion"),
            "cuda_driver_version_raw": cuda,
            "cuda_driver_version": cuda_driver_version_text(cuda) if isinstance(cuda, int) else cuda,
            "gpu_count": len(handles),
            "gpus": [_gpu_facts(pynvml, i, h) for i, h in enumerate(handles)],
            "p2p": _p2p_pairs(pynvml, handles),
        }
    except pynvml.NVMLError as err:
        return {"available": False, "reason": f"NVML: {err}", "reason_code": nvml_reader.failure_reason(err)}
    finally:
        with contextlib.suppress(pynvml.NVMLError):
            pynvml.nvmlShutdown()


def p2p_supported_all_pairs(snapshot: dict[str, Any]) -> bool | None:
    """True when every GPU pair reports P2P 'ok', False when any does not, None with fewer than 2 GPUs."""
    if not snapshot.get("available") or len(snapshot.get("gpus", [])) < 2:
        return None
    return all(pair["status"] == "ok" for pair in snapshot.get("p2p", []))


def p2p_reason(snapshot: dict[str, Any]) -> str:
    """One line on why P2P is or is not usable, for the NCCL environment file's header."""
    if not snapshot.get("available"):
        return f"no NVML: {snapshot.get('reason', 'unknown')}"
    pairs = snapshot.get("p2p", [])
    if not pairs:
        return f"{len(snapshot.get('gpus', []))} GPU(s): no GPU pairs"
    return "P2P status " + ", ".join(f"GPU{p['a']}-GPU{p['b']}: {p['status']}" for p in pairs)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python3 -m service.host.nvidia", description=__doc__.splitlines()[0])
    parser.add_argument("--json", action="store_true", help="print the NVML snapshot and /proc facts as JSON")
    parser.add_argument("--cuda", metavar="X.Y",
                        help="also report min_driver_for_cuda for a CUDA X.Y build (version_chain's table)")
    args = parser.parse_args(argv)
    snapshot = nvml_snapshot()
    snapshot["p2p_supported_all_pairs"] = p2p_supported_all_pairs(snapshot)
    snapshot["p2p_reason"] = p2p_reason(snapshot)
    snapshot["proc"] = read_proc_driver()
    if args.cuda:
        try:
            snapshot["min_driver_for_cuda"] = version_chain.minimum_driver_for_cuda(args.cuda)
        except ValueError as err:
            print(f"error: --cuda: {err}", file=sys.stderr)
            return 2
    if args.json:
        print(json.dumps(snapshot, indent=2, sort_keys=True))
    else:
        for key, value in sorted(snapshot.items()):
            print(f"{key}: {value}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
