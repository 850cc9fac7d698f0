"""The project's one NVML reader (runs on the host's system python and in the GPU exporter's venv; stdlib only).

verify's snapshot (``service.host.nvidia``) and the GPU exporter (``service.venv.gpu_exporter``) read every
per-GPU value through ``read_fields`` and one table, ``FIELDS``; the caller hands in the ``pynvml`` module
(nvidia-ml-py), which is optional on the host: ``load`` says why it is not there. Where NVML cannot give a value
the reading is ``UNSUPPORTED`` (the card does not have it) or a ``CallError`` (text ``error: ...`` with the NVML
code), never an exception, so one gap never hides the rest.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

UNSUPPORTED = "unsupported"

# nvml.h return codes this reader names (stable ABI values; pynvml exposes the same as NVML_ERROR_*).
NVML_ERROR_UNINITIALIZED = 1
NVML_ERROR_NOT_SUPPORTED = 3
NVML_ERROR_NO_PERMISSION = 4
NVML_ERROR_DRIVER_NOT_LOADED = 9
NVML_ERROR_TIMEOUT = 10
NVML_ERROR_LIBRARY_NOT_FOUND = 12
NVML_ERROR_FUNCTION_NOT_FOUND = 13
NVML_ERROR_GPU_IS_LOST = 15
NVML_ERROR_LIB_RM_VERSION_MISMATCH = 18

# Why NVML is not usable, as a short label (the exporter's gptoss_nvml_error_info{reason}, verify's snapshot).
REASON_BY_CODE = {
    NVML_ERROR_LIBRARY_NOT_FOUND: "library_not_found",
    NVML_ERROR_DRIVER_NOT_LOADED: "driver_not_loaded",
    NVML_ERROR_NO_PERMISSION: "no_permission",
    NVML_ERROR_GPU_IS_LOST: "gpu_lost",
    NVML_ERROR_LIB_RM_VERSION_MISMATCH: "driver_library_mismatch",
    NVML_ERROR_UNINITIALIZED: "uninitialized",
}
REASON_PYNVML_MISSING = "pynvml_not_installed"
REASON_UNKNOWN = "unknown"
REASONS = (*REASON_BY_CODE.values(), REASON_PYNVML_MISSING, REASON_UNKNOWN)


class CallError(str):
    """'error: <NVML's text>' (what verify prints), carrying NVML's return code for callers that act on it."""

    code: int | None

    def __new__(cls, text: str, code: int | None) -> CallError:
        obj = super().__new__(cls, text)
        obj.code = code
        return obj


def text(value: Any) -> Any:
    return value.decode() if isinstance(value, bytes) else value


def failure_reason(err: BaseException) -> str:
    """An NVMLError (or ImportError of pynvml) -> one of REASONS."""
    if isinstance(err, ImportError):
        return REASON_PYNVML_MISSING
    return REASON_BY_CODE.get(getattr(err, "value", None), REASON_UNKNOWN)


def load() -> tuple[Any, str]:
    """(the pynvml module, '') or (None, why it is not importable)."""
    try:
        return importlib.import_module("pynvml"), ""
    except ImportError as err:
        return None, f"pynvml not importable ({err}); install nvidia-ml-py"


def call(pynvml: Any, fn_name: str, *args: Any) -> Any:
    """One NVML call: its value, UNSUPPORTED (the card or the library lacks it) or a CallError."""
    fn = getattr(pynvml, fn_name, None)
    if fn is None:
        return UNSUPPORTED
    try:
        return text(fn(*args))
    except pynvml.NVMLError as err:
        code = getattr(err, "value", None)
        if code in (NVML_ERROR_NOT_SUPPORTED, NVML_ERROR_FUNCTION_NOT_FOUND):
            return UNSUPPORTED
        return CallError(f"error: {err}", code)


def readable(value: Any) -> bool:
    return value != UNSUPPORTED and not isinstance(value, CallError)


@dataclass(frozen=True)
class Field:
    """One per-GPU reading: the pynvml function, its arguments after the handle (nvml.h enum values as
    literals), and what to take from the answer. Fields on one call (memory total/used) share one call."""

    fn: str
    args: tuple[int, ...] = ()
    pick: Callable[[Any], Any] | None = None


def _attr(name: str) -> Callable[[Any], Any]:
    return lambda value: text(getattr(value, name))


def _item(index: int) -> Callable[[Any], Any]:
    return lambda value: value[index]


# nvml.h enums used below: NVML_TEMPERATURE_GPU 0; NVML_CLOCK_SM 1, NVML_CLOCK_MEM 2;
# NVML_MEMORY_ERROR_TYPE_CORRECTED 0 / _UNCORRECTED 1; NVML_VOLATILE_ECC 0 (since the driver loaded).
FIELDS: dict[str, Field] = {
    "name": Field("nvmlDeviceGetName"),
    "uuid": Field("nvmlDeviceGetUUID"),
    "pci_bus_id": Field("nvmlDeviceGetPciInfo", pick=_attr("busId")),
    "persistence_mode": Field("nvmlDeviceGetPersistenceMode"),
    "pcie_gen_current": Field("nvmlDeviceGetCurrPcieLinkGeneration"),
    "pcie_gen_max": Field("nvmlDeviceGetMaxPcieLinkGeneration"),
    "pcie_width_current": Field("nvmlDeviceGetCurrPcieLinkWidth"),
    "pcie_width_max": Field("nvmlDeviceGetMaxPcieLinkWidth"),
    "pcie_replay_count": Field("nvmlDeviceGetPcieReplayCounter"),
    "memory_total_bytes": Field("nvmlDeviceGetMemoryInfo", pick=_attr("total")),
    "memory_used_bytes": Field("nvmlDeviceGetMemoryInfo", pick=_attr("used")),
    # (enabled, default) pair as NVML returns it, e.g. [1, 1].
    "gsp_firmware_mode": Field("nvmlDeviceGetGspFirmwareMode", pick=list),
    "gsp_firmware_version": Field("nvmlDeviceGetGspFirmwareVersion"),
    "sm_utilization_percent": Field("nvmlDeviceGetUtilizationRates", pick=_attr("gpu")),
    # nvmlDeviceGetTemperature: the call every driver from the project's floor (R535) has.
    "temperature_celsius": Field("nvmlDeviceGetTemperature", (0,)),
    "power_milliwatts": Field("nvmlDeviceGetPowerUsage"),
    "power_limit_milliwatts": Field("nvmlDeviceGetEnforcedPowerLimit"),
    "clock_sm_mhz": Field("nvmlDeviceGetClockInfo", (1,)),
    "clock_memory_mhz": Field("nvmlDeviceGetClockInfo", (2,)),
    "clock_event_reasons": Field("nvmlDeviceGetCurrentClocksEventReasons"),
    "ecc_corrected_volatile": Field("nvmlDeviceGetTotalEccErrors", (0, 0)),
    "ecc_uncorrected_volatile": Field("nvmlDeviceGetTotalEccErrors", (1, 0)),
    # (correctable, uncorrectable, pending, failure): rows remapped for each reason, and two flags.
    "remapped_rows_correctable": Field("nvmlDeviceGetRemappedRows", pick=_item(0)),
    "remapped_rows_uncorrectable": Field("nvmlDeviceGetRemappedRows", pick=_item(1)),
    "remapped_rows_pending": Field("nvmlDeviceGetRemappedRows", pick=_item(2)),
    "remapped_rows_failure": Field("nvmlDeviceGetRemappedRows", pick=_item(3)),
}

# nvmlClocksEventReason* bits (nvml.h) by the label the exporter gives them.
CLOCK_EVENT_REASONS = {
    "gpu_idle": 0x1,
    "applications_clocks_setting": 0x2,
    "sw_power_cap": 0x4,
    "hw_slowdown": 0x8,
    "sync_boost": 0x10,
    "sw_thermal_slowdown": 0x20,
    "hw_thermal_slowdown": 0x40,
    "hw_power_brake_slowdown": 0x80,
    "display_clock_setting": 0x100,
}


def read_fields(pynvml: Any, handle: Any, names: list[str] | tuple[str, ...]) -> dict[str, Any]:
    """{name: reading} for the named FIELDS of one GPU; each NVML call made once."""
    answers: dict[tuple[str, tuple[int, ...]], Any] = {}
    readings: dict[str, Any] = {}
    for name in names:
        field = FIELDS[name]
        key = (field.fn, field.args)
        if key not in answers:
            answers[key] = call(pynvml, field.fn, handle, *field.args)
        answer = answers[key]
        readings[name] = field.pick(answer) if field.pick and readable(answer) else answer
    return readings


def gpu_lost(readings: dict[str, Any]) -> bool:
    """Whether any reading says the GPU fell off the bus (NVML_ERROR_GPU_IS_LOST)."""
    return any(isinstance(v, CallError) and v.code == NVML_ERROR_GPU_IS_LOST for v in readings.values())
