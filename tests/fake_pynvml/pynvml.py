"""A FAKE of nvidia-ml-py's pynvml, for the GPU exporter's ERROR PATHS only (tests/test_gpu_exporter.py).

This machine has no NVIDIA driver, so a lost GPU, a field the card does not support, a driver that loads
after the exporter started, a GPU that refuses XID registration or an XID event cannot happen here. Put this
folder first on PYTHONPATH and the real exporter process imports this module instead of pynvml. Its state is
re-read on every call from the JSON file named by $FAKE_PYNVML_STATE, so a test changes it while the exporter
runs; every nvmlInit call appends a line to $FAKE_PYNVML_STATE.inits. The normal readings are plain numbers,
not a model of any card: the exporter's real output is measured on a GPU machine (bench/gpu_exporter_scrape.py).
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path
from types import SimpleNamespace

NVML_ERROR_UNINITIALIZED = 1
NVML_ERROR_NOT_SUPPORTED = 3
NVML_ERROR_DRIVER_NOT_LOADED = 9
NVML_ERROR_TIMEOUT = 10
NVML_ERROR_GPU_IS_LOST = 15


class NVMLError(Exception):
    def __init__(self, value: int):
        super().__init__(value)
        self.value = value

    def __str__(self) -> str:
        return {3: "Not Supported", 9: "Driver Not Loaded", 10: "Timeout", 15: "GPU is lost"}.get(
            self.value, f"fake error {self.value}")


def _state() -> dict:
    with open(os.environ["FAKE_PYNVML_STATE"], encoding="utf-8") as handle:
        return json.load(handle)


def _gpu(handle: int, fn: str) -> dict:
    gpus = _state()["gpus"]
    if handle >= len(gpus):
        raise NVMLError(2)
    gpu = gpus[handle]
    if gpu.get("lost"):
        raise NVMLError(NVML_ERROR_GPU_IS_LOST)
    if fn in gpu.get("unsupported", []):
        raise NVMLError(NVML_ERROR_NOT_SUPPORTED)
    return gpu


def nvmlInit() -> None:
    with open(os.environ["FAKE_PYNVML_STATE"] + ".inits", "a", encoding="utf-8") as handle:
        handle.write(f"{time.time()}\n")
    if _state().get("init_error"):
        raise NVMLError(_state()["init_error"])


def nvmlShutdown() -> None:
    pass


def nvmlSystemGetDriverVersion() -> str:
    return "fake"


def nvmlDeviceGetCount() -> int:
    return len(_state()["gpus"])


def nvmlDeviceGetHandleByIndex(index: int) -> int:
    _gpu(index, "nvmlDeviceGetHandleByIndex")
    return index


def _reading(fn: str, value):
    def call(handle, *args):
        _gpu(handle, fn)
        return value(handle, *args) if callable(value) else value
    call.__name__ = fn
    return call


nvmlDeviceGetName = _reading("nvmlDeviceGetName", lambda h: _state()["gpus"][h]["name"])
nvmlDeviceGetUUID = _reading("nvmlDeviceGetUUID", lambda h: _state()["gpus"][h]["uuid"])
nvmlDeviceGetPciInfo = _reading("nvmlDeviceGetPciInfo", lambda h: SimpleNamespace(busId=f"00000000:0{h}:00.0"))
nvmlDeviceGetPersistenceMode = _reading("nvmlDeviceGetPersistenceMode", 1)
nvmlDeviceGetCurrPcieLinkGeneration = _reading("nvmlDeviceGetCurrPcieLinkGeneration", 4)
nvmlDeviceGetMaxPcieLinkGeneration = _reading("nvmlDeviceGetMaxPcieLinkGeneration", 4)
nvmlDeviceGetCurrPcieLinkWidth = _reading("nvmlDeviceGetCurrPcieLinkWidth", 16)
nvmlDeviceGetMaxPcieLinkWidth = _reading("nvmlDeviceGetMaxPcieLinkWidth", 16)
nvmlDeviceGetPcieReplayCounter = _reading("nvmlDeviceGetPcieReplayCounter", 3)
nvmlDeviceGetMemoryInfo = _reading("nvmlDeviceGetMemoryInfo", SimpleNamespace(total=24 << 30, used=1 << 30))
nvmlDeviceGetGspFirmwareMode = _reading("nvmlDeviceGetGspFirmwareMode", (1, 1))
nvmlDeviceGetGspFirmwareVersion = _reading("nvmlDeviceGetGspFirmwareVersion", "fake")
nvmlDeviceGetUtilizationRates = _reading("nvmlDeviceGetUtilizationRates", SimpleNamespace(gpu=37, memory=5))
nvmlDeviceGetTemperature = _reading("nvmlDeviceGetTemperature", 45)
nvmlDeviceGetPowerUsage = _reading("nvmlDeviceGetPowerUsage", 123_000)
nvmlDeviceGetEnforcedPowerLimit = _reading("nvmlDeviceGetEnforcedPowerLimit", 425_000)
nvmlDeviceGetClockInfo = _reading("nvmlDeviceGetClockInfo", lambda h, clock: {1: 2520, 2: 10501}[clock])
nvmlDeviceGetCurrentClocksEventReasons = _reading("nvmlDeviceGetCurrentClocksEventReasons", 0x1 | 0x40)
nvmlDeviceGetTotalEccErrors = _reading("nvmlDeviceGetTotalEccErrors", lambda h, kind, counter: 2 if kind else 7)
nvmlDeviceGetRemappedRows = _reading("nvmlDeviceGetRemappedRows", (1, 0, 0, 0))
nvmlDeviceGetP2PStatus = _reading("nvmlDeviceGetP2PStatus", 0)


def nvmlEventSetCreate() -> list:
    return []


def nvmlDeviceRegisterEvents(handle: int, event_types: int, event_set: list) -> None:
    _gpu(handle, "nvmlDeviceRegisterEvents")
    event_set.append(handle)


def nvmlEventSetWait_v2(event_set: list, timeout_ms: int):
    """Delivers each XID listed in the state's "xid" ([gpu index, code]) once, then times out."""
    path = os.environ["FAKE_PYNVML_STATE"] + ".xid-delivered"
    delivered = int(Path(path).read_text()) if os.path.exists(path) else 0
    pending = _state().get("xid", [])[delivered:]
    if pending and pending[0][0] in event_set:
        Path(path).write_text(str(delivered + 1))
        return SimpleNamespace(device=pending[0][0], eventType=0x8, eventData=pending[0][1])
    time.sleep(min(timeout_ms, 200) / 1000)
    raise NVMLError(NVML_ERROR_TIMEOUT)


def nvmlEventSetFree(event_set: list) -> None:
    pass
