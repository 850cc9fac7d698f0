"""gptoss-gpu-exporter: per-GPU metrics for Prometheus, read through the project's one NVML reader.

Runs in its own small venv (prometheus-client, nvidia-ml-py) as ``python -m service.venv.gpu_exporter``.
Every scrape reads NVML afresh through ``service.host.nvml_reader``. Without a driver, a library or with a lost
GPU it keeps serving: ``gptoss_nvml_up 0`` with ``gptoss_nvml_error_info{reason}``, and it tries NVML's init
again on a scrape (at most once per ``--retry-interval``), so it recovers when NVML comes back. XID events
arrive through an NVML event set, waited on by a background thread.
"""

from __future__ import annotations

import argparse
import logging
import signal
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from prometheus_client import CollectorRegistry, ProcessCollector, start_http_server
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from service.host import nvml_reader

LOG = logging.getLogger("gptoss-gpu-exporter")
GPU_LABELS = ("gpu", "uuid", "name")


@dataclass(frozen=True)
class Family:
    """One metric family: the name PromQL sees (counters end in _total), its type, help, extra labels."""

    name: str
    kind: str  # gauge | counter
    help: str
    labels: tuple[str, ...] = ()


# The one list of what the exporter serves (issue 25's contract). Rules, dashboards and their tests
# (tests/test_monitoring_rules.py) import it; a family not here is never served.
FAMILIES: tuple[Family, ...] = (
    Family("gptoss_nvml_up", "gauge", "1 when NVML answered this scrape, 0 when it is unavailable"),
    Family("gptoss_nvml_error_info", "gauge", "1 with the reason while NVML is unavailable or a GPU is lost",
           ("reason",)),
    Family("gptoss_gpu_count", "gauge", "GPUs NVML enumerates and can read (0 while NVML is unavailable)"),
    Family("gptoss_gpu_sm_utilization_ratio", "gauge", "Share of the last sample period a kernel ran (0..1)",
           GPU_LABELS),
    Family("gptoss_gpu_memory_used_bytes", "gauge", "Frame buffer memory in use", GPU_LABELS),
    Family("gptoss_gpu_memory_total_bytes", "gauge", "Frame buffer memory installed", GPU_LABELS),
    Family("gptoss_gpu_temperature_celsius", "gauge", "GPU core temperature", GPU_LABELS),
    Family("gptoss_gpu_power_watts", "gauge", "Power draw of the board", GPU_LABELS),
    Family("gptoss_gpu_power_limit_watts", "gauge", "Power limit the driver enforces", GPU_LABELS),
    Family("gptoss_gpu_clock_sm_hertz", "gauge", "SM clock", GPU_LABELS),
    Family("gptoss_gpu_clock_memory_hertz", "gauge", "Memory clock", GPU_LABELS),
    Family("gptoss_gpu_clock_event_active", "gauge", "1 while this reason holds the clocks down (throttling)",
           (*GPU_LABELS, "reason")),
    Family("gptoss_gpu_pcie_link_gen", "gauge", "Current PCIe link generation", GPU_LABELS),
    Family("gptoss_gpu_pcie_link_gen_max", "gauge", "Maximum PCIe link generation of GPU and slot", GPU_LABELS),
    Family("gptoss_gpu_pcie_link_width", "gauge", "Current PCIe link width (lanes)", GPU_LABELS),
    Family("gptoss_gpu_pcie_link_width_max", "gauge", "Maximum PCIe link width (lanes)", GPU_LABELS),
    Family("gptoss_gpu_pcie_replay_total", "counter", "PCIe replays (link-level retransmissions)", GPU_LABELS),
    Family("gptoss_gpu_ecc_errors_total", "counter", "ECC errors since the driver loaded (volatile)",
           (*GPU_LABELS, "type")),
    Family("gptoss_gpu_remapped_rows", "gauge", "Rows remapped (correctable, uncorrectable) and the "
           "pending/failure flags", (*GPU_LABELS, "kind")),
    Family("gptoss_gpu_xid_events_total", "counter", "XID events NVML delivered since the exporter started",
           (*GPU_LABELS, "xid")),
    Family("gptoss_gpu_xid_watch_active", "gauge", "1 when XID events of this GPU are watched, 0 when NVML "
           "refused to register them", GPU_LABELS),
    Family("gptoss_gpu_field_unsupported_info", "gauge", "1 for each reading this GPU does not support (left "
           "out of its family)", (*GPU_LABELS, "field")),
    Family("gptoss_nvml_read_errors_total", "counter", "NVML readings that failed (other than unsupported)",
           ("field",)),
)
FAMILY_NAMES = tuple(f.name for f in FAMILIES)
_BY_NAME = {f.name: f for f in FAMILIES}

# family -> (reader field, scale) for the one-value-per-GPU families.
SIMPLE: dict[str, tuple[str, float]] = {
    "gptoss_gpu_sm_utilization_ratio": ("sm_utilization_percent", 0.01),
    "gptoss_gpu_memory_used_bytes": ("memory_used_bytes", 1),
    "gptoss_gpu_memory_total_bytes": ("memory_total_bytes", 1),
    "gptoss_gpu_temperature_celsius": ("temperature_celsius", 1),
    "gptoss_gpu_power_watts": ("power_milliwatts", 0.001),
    "gptoss_gpu_power_limit_watts": ("power_limit_milliwatts", 0.001),
    "gptoss_gpu_clock_sm_hertz": ("clock_sm_mhz", 1e6),
    "gptoss_gpu_clock_memory_hertz": ("clock_memory_mhz", 1e6),
    "gptoss_gpu_pcie_link_gen": ("pcie_gen_current", 1),
    "gptoss_gpu_pcie_link_gen_max": ("pcie_gen_max", 1),
    "gptoss_gpu_pcie_link_width": ("pcie_width_current", 1),
    "gptoss_gpu_pcie_link_width_max": ("pcie_width_max", 1),
    "gptoss_gpu_pcie_replay_total": ("pcie_replay_count", 1),
}
# family -> (label name, {label value: reader field}) for the families with one series per kind.
BY_KIND: dict[str, tuple[str, dict[str, str]]] = {
    "gptoss_gpu_ecc_errors_total": ("type", {"corrected": "ecc_corrected_volatile",
                                              "uncorrected": "ecc_uncorrected_volatile"}),
    "gptoss_gpu_remapped_rows": ("kind", {"correctable": "remapped_rows_correctable",
                                          "uncorrectable": "remapped_rows_uncorrectable",
                                          "pending": "remapped_rows_pending",
                                          "failure": "remapped_rows_failure"}),
}
READ_FIELDS = ("name", "uuid", *(f for f, _ in SIMPLE.values()), "clock_event_reasons",
               *(f for _, kinds in BY_KIND.values() for f in kinds.values()))
XID_EVENT_TYPE = 0x8  # nvmlEventTypeXidCriticalError
# NVML errors after a good init that mean the library must be initialised again (driver reloaded, gone).
REINIT_CODES = {nvml_reader.NVML_ERROR_UNINITIALIZED, nvml_reader.NVML_ERROR_DRIVER_NOT_LOADED,
                nvml_reader.NVML_ERROR_LIB_RM_VERSION_MISMATCH, nvml_reader.NVML_ERROR_LIBRARY_NOT_FOUND}


def family(name: str) -> Metric:
    spec = _BY_NAME[name]
    labels = list(spec.labels)
    if spec.kind == "counter":
        return CounterMetricFamily(name, spec.help, labels=labels)
    return GaugeMetricFamily(name, spec.help, labels=labels)


class Nvml:
    """NVML's state for the process: initialised once, given up on a failure, tried again at most every
    retry_s (on a scrape). nvmlShutdown is never called while serving: the XID thread may be waiting on an
    event set, and a second nvmlInit only counts up a reference."""

    def __init__(self, retry_s: float):
        self.retry_s = retry_s
        self.pynvml: Any = None
        self.ready = False
        self.reason = nvml_reader.REASON_UNKNOWN
        self.message = "not tried yet"
        self.generation = 0  # counts good inits: the XID thread registers again on a change
        self._next_try = 0.0
        self._lock = threading.Lock()

    def ensure(self) -> bool:
        with self._lock:
            if self.ready:
                return True
            now = time.monotonic()
            if now < self._next_try:
                return False
            self._next_try = now + self.retry_s
            if self.pynvml is None:
                self.pynvml, why = nvml_reader.load()
                if self.pynvml is None:
                    return self._down(nvml_reader.REASON_PYNVML_MISSING, why)
            try:
                self.pynvml.nvmlInit()
            except self.pynvml.NVMLError as err:
                return self._down(nvml_reader.failure_reason(err), f"nvmlInit: {err}")
            self.ready, self.generation = True, self.generation + 1
            LOG.info("NVML initialised (driver %s)", nvml_reader.call(self.pynvml, "nvmlSystemGetDriverVersion"))
            return True

    def fail(self, err: Exception, what: str) -> None:
        """A call after a good init failed in a way that needs a new init."""
        with self._lock:
            self.ready = False
            self._down(nvml_reader.failure_reason(err), f"{what}: {err}")

    def _down(self, reason: str, message: str) -> bool:
        if (reason, message) != (self.reason, self.message):
            LOG.warning("NVML unavailable (%s): %s; serving gptoss_nvml_up 0, next try in %g s or later",
                        reason, message, self.retry_s)
        self.reason, self.message = reason, message
        return False


class XidWatcher(threading.Thread):
    """Registers every GPU for XID events and counts them by (GPU, XID). A GPU NVML refuses to register
    (NOT_SUPPORTED, e.g. some consumer cards or in a VM) is logged and shown as gptoss_gpu_xid_watch_active 0."""

    WAIT_MS = 1000

    def __init__(self, nvml: Nvml):
        super().__init__(name="xid-watcher", daemon=True)
        self.nvml = nvml
        self.counts: dict[tuple[str, str, str, str], int] = {}
        self.watched: dict[str, bool] = {}  # uuid -> registered
        self.lock = threading.Lock()
        self.stop = threading.Event()
        self._start_requested = False

    def start_once(self) -> None:
        """Started with the first good init (at start-up or on a later scrape), once."""
        with self.lock:
            if self._start_requested:
                return
            self._start_requested = True
        self.start()

    def run(self) -> None:
        while not self.stop.is_set():
            if not self.nvml.ready:
                self.stop.wait(1.0)
                continue
            try:
                self._watch(self.nvml.pynvml, self.nvml.generation)
            except Exception as err:  # never let the thread die: the next round registers again
                LOG.warning("XID watch stopped (%s: %s); registering again in 5 s", type(err).__name__, err)
                self.stop.wait(5.0)

    def _register(self, pynvml: Any) -> tuple[Any, dict[str, tuple[str, str, str]]]:
        event_set = pynvml.nvmlEventSetCreate()
        gpus: dict[str, tuple[str, str, str]] = {}
        watched: dict[str, bool] = {}
        for index in range(pynvml.nvmlDeviceGetCount()):
            handle = pynvml.nvmlDeviceGetHandleByIndex(index)
            uuid = str(nvml_reader.text(pynvml.nvmlDeviceGetUUID(handle)))
            gpus[uuid] = (str(index), uuid, str(nvml_reader.text(pynvml.nvmlDeviceGetName(handle))))
            try:
                pynvml.nvmlDeviceRegisterEvents(handle, XID_EVENT_TYPE, event_set)
                watched[uuid] = True
            except pynvml.NVMLError as err:
                watched[uuid] = False
                LOG.warning("GPU %s (%s): XID events cannot be watched: %s", index, uuid, err)
        with self.lock:
            self.watched = watched
        return event_set, gpus

    def _watch(self, pynvml: Any, generation: int) -> None:
        event_set, gpus = self._register(pynvml)
        try:
            while not self.stop.is_set() and self.nvml.ready and self.nvml.generation == generation:
                if not any(self.watched.values()):
                    self.stop.wait(5.0)
                    continue
                try:
                    data = pynvml.nvmlEventSetWait_v2(event_set, self.WAIT_MS)
                except pynvml.NVMLError as err:
                    if getattr(err, "value", None) == nvml_reader.NVML_ERROR_TIMEOUT:
                        continue
                    raise
                if not data.eventType & XID_EVENT_TYPE:
                    continue
                uuid = str(nvml_reader.text(pynvml.nvmlDeviceGetUUID(data.device)))
                key = (*gpus.get(uuid, ("?", uuid, "?")), str(int(data.eventData)))
                LOG.warning("XID %s on GPU %s (%s)", key[3], key[0], uuid)
                with self.lock:
                    self.counts[key] = self.counts.get(key, 0) + 1
        finally:
            try:
                pynvml.nvmlEventSetFree(event_set)
            except pynvml.NVMLError:
                pass


class GpuCollector(Collector):
    """What one scrape serves: NVML read afresh, through nvml_reader."""

    def __init__(self, nvml: Nvml, xid: XidWatcher):
        self.nvml = nvml
        self.xid = xid
        self.read_errors: dict[str, int] = {}

    def collect(self) -> Iterator[Metric]:
        out = {name: family(name) for name in FAMILY_NAMES}
        if self.nvml.ensure():
            reason = self._read_gpus(out)
        else:
            reason = self.nvml.reason
            out["gptoss_gpu_count"].add_metric([], 0)
        out["gptoss_nvml_up"].add_metric([], 0 if reason else 1)
        if reason:
            out["gptoss_nvml_error_info"].add_metric([reason], 1)
        for field, count in sorted(self.read_errors.items()):
            out["gptoss_nvml_read_errors_total"].add_metric([field], count)
        if self.nvml.ready:
            self.xid.start_once()
        yield from out.values()

    def _read_gpus(self, out: dict[str, Metric]) -> str:
        """Fill the per-GPU families; the reason NVML counts as down ('' when it is up)."""
        pynvml = self.nvml.pynvml
        try:
            count = pynvml.nvmlDeviceGetCount()
        except pynvml.NVMLError as err:
            self.nvml.fail(err, "nvmlDeviceGetCount")
            out["gptoss_gpu_count"].add_metric([], 0)
            return self.nvml.reason
        readable, lost = 0, 0
        with self.xid.lock:
            watched, xid_counts = dict(self.xid.watched), dict(self.xid.counts)
        for index in range(count):
            try:
                handle = pynvml.nvmlDeviceGetHandleByIndex(index)
            except pynvml.NVMLError as err:
                lost += nvml_reader.failure_reason(err) == "gpu_lost"
                self._error(f"handle (GPU {index})", err)
                continue
            readings = nvml_reader.read_fields(pynvml, handle, READ_FIELDS)
            if nvml_reader.gpu_lost(readings):
                lost += 1
                continue
            readable += 1
            self._add_gpu(out, str(index), readings, watched)
        for (gpu, uuid, name, code), n in sorted(xid_counts.items()):
            out["gptoss_gpu_xid_events_total"].add_metric([gpu, uuid, name, code], n)
        out["gptoss_gpu_count"].add_metric([], readable)
        return "gpu_lost" if lost else ""

    def _add_gpu(self, out: dict[str, Metric], index: str, readings: dict[str, Any], watched: dict[str, bool]) -> None:
        labels = [index, str(readings["uuid"]), str(readings["name"])]
        unsupported: list[str] = []

        def value(field: str) -> float | None:
            reading = readings[field]
            if nvml_reader.readable(reading):
                return float(reading)
            if reading == nvml_reader.UNSUPPORTED:
                unsupported.append(field)
            else:
                self._error(field, reading)
            return None

        for name, (field, scale) in SIMPLE.items():
            found = value(field)
            if found is not None:
                out[name].add_metric(labels, found * scale)
        reasons = value("clock_event_reasons")
        if reasons is not None:
            for reason, bit in nvml_reader.CLOCK_EVENT_REASONS.items():
                out["gptoss_gpu_clock_event_active"].add_metric([*labels, reason], 1 if int(reasons) & bit else 0)
        for name, (_, kinds) in BY_KIND.items():
            for kind, field in kinds.items():
                found = value(field)
                if found is not None:
                    out[name].add_metric([*labels, kind], found)
        if labels[1] in watched:
            out["gptoss_gpu_xid_watch_active"].add_metric(labels, 1 if watched[labels[1]] else 0)
        for field in sorted(set(unsupported)):
            out["gptoss_gpu_field_unsupported_info"].add_metric([*labels, field], 1)

    def _error(self, field: str, err: Any) -> None:
        key = field.split(" (")[0]
        if key not in self.read_errors:
            LOG.warning("NVML reading %s failed: %s (counted in gptoss_nvml_read_errors_total)", field, err)
        self.read_errors[key] = self.read_errors.get(key, 0) + 1


def build_registry(retry_s: float) -> tuple[CollectorRegistry, Nvml, XidWatcher]:
    nvml = Nvml(retry_s)
    xid = XidWatcher(nvml)
    registry = CollectorRegistry(auto_describe=False)
    registry.register(GpuCollector(nvml, xid))
    # process_cpu_seconds_total and friends: what the exporter itself costs (the bench reads them too).
    ProcessCollector(registry=registry)
    return registry, nvml, xid


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m service.venv.gpu_exporter", description=__doc__.splitlines()[0])
    parser.add_argument("--listen-address", default="127.0.0.1", help="address to serve /metrics on")
    parser.add_argument("--port", type=int, default=9835, help="port (default 9835)")
    parser.add_argument("--retry-interval", type=float, default=10.0, metavar="SECONDS",
                        help="while NVML is unavailable, try its init again on a scrape at most this often")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(message)s", stream=sys.stderr)
    # The handlers come before the server: a stop that arrives as soon as /metrics answers must end
    # the exporter cleanly (exit 0), not by the signal's default action (a loaded test run caught that).
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    registry, nvml, xid = build_registry(args.retry_interval)
    nvml.ensure()  # the first state is in the log at once, not at the first scrape
    if nvml.ready:
        xid.start_once()
    try:
        server, _ = start_http_server(args.port, addr=args.listen_address, registry=registry)
    except OSError as err:
        LOG.error("cannot listen on %s:%s: %s", args.listen_address, args.port, err)
        return 2
    LOG.info("serving /metrics on %s:%s", args.listen_address, args.port)
    stop.wait()
    xid.stop.set()
    server.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
