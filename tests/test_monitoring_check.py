"""monitoring_check's pure parts, against values the real services printed."""

import http.server
import signal
import socket
import subprocess
import threading
import time
from pathlib import Path

import pytest

from service.host import monitoring_check

DATA = Path(__file__).parent / "data"
PROMETHEUS = Path(__file__).resolve().parents[1] / ".cache" / "tools" / "prometheus-2.42" / "usr" / "bin" / "prometheus"


def test_alertmanager_config_hash_matches_what_alertmanager_exports():
    """Alertmanager 0.25 (Debian 12's prometheus-alertmanager, run by hand on this file) exported
    `alertmanager_config_hash 2.38955905961135e+14`: MON-003 compares it with the file's."""
    data = (DATA / "alertmanager-0.25-hash.yml").read_bytes()
    assert monitoring_check.alertmanager_config_hash(data) == 238955905961135.0
    assert monitoring_check.alertmanager_config_hash(data + b"\n") != 238955905961135.0


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


class Metrics(http.server.BaseHTTPRequestHandler):
    def do_GET(self):  # noqa: N802 - the stdlib's name
        body = b"gptoss_test_up 1\n"
        self.send_response(200)
        self.send_header("Content-Type", "text/plain; version=0.0.4")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args):
        pass


def scrape_config(*targets: int) -> str:
    """A configuration scraping each port as its own job (x, then y), every 2 s."""
    jobs = "".join(f"  - job_name: {job}\n    static_configs: [{{targets: ['127.0.0.1:{port}']}}]\n"
                   for job, port in zip("xy"[:len(targets)], targets, strict=True))
    return f"global: {{scrape_interval: 2s, scrape_timeout: 1s}}\nscrape_configs:\n{jobs}"


@pytest.fixture
def prometheus_process(tmp_path):
    """Debian 12's real Prometheus 2.42 (`invoke promtool` extracts it), scraping one target every 2 s:
    (its URL, the target's port, its configuration file, the process)."""
    if not PROMETHEUS.exists():
        pytest.fail(f"{PROMETHEUS} missing: run `invoke promtool`")
    port, target = free_port(), free_port()
    config = tmp_path / "p.yml"
    config.write_text(scrape_config(target))
    proc = subprocess.Popen([str(PROMETHEUS), f"--config.file={config}",
                             f"--storage.tsdb.path={tmp_path / 'data'}", f"--web.listen-address=127.0.0.1:{port}"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        yield f"http://127.0.0.1:{port}", target, config, proc
    finally:
        proc.terminate()
        proc.wait(timeout=30)


@pytest.fixture
def prometheus(prometheus_process):
    base, target, _, _ = prometheus_process
    return base, target


def serve_metrics(port: int) -> http.server.ThreadingHTTPServer:
    server = http.server.ThreadingHTTPServer(("127.0.0.1", port), Metrics)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server


def health(base: str) -> str:
    try:
        active = monitoring_check.prometheus_data(base, "/api/v1/targets?state=active", 2)["activeTargets"]
    except OSError:
        return "no answer"
    return active[0]["health"] if active else "none"


def test_a_target_back_since_its_last_scrape_is_not_reported_down(prometheus):
    """verify right after vLLM came back: Prometheus's last scrape (during the restart) says down; MON-001
    waits for a scrape newer than its question instead of failing on the stale one, and a target that is
    really down is still reported, after at most one interval (+ 5 s). (A stale "up" is taken as it is:
    the API checks see a server that is down.)"""
    base, port = prometheus
    deadline = time.monotonic() + 60
    while health(base) != "down":
        assert time.monotonic() < deadline, "Prometheus never scraped the (closed) target"
        time.sleep(0.3)
    server = serve_metrics(port)
    key = f"x 127.0.0.1:{port}"
    try:
        found = monitoring_check.targets(base, [key], 5)
        assert found["up"] == [key] and found["down"] == {}, found
    finally:
        server.shutdown()
        server.server_close()
    while health(base) != "down":
        assert time.monotonic() < deadline + 30, "Prometheus never saw the target go"
        time.sleep(0.3)
    started = time.monotonic()
    found = monitoring_check.targets(base, [key], 5)
    assert list(found["down"]) == [key], found
    assert time.monotonic() - started < 2 + 5 + 2


def test_a_target_added_by_a_reload_just_now_is_waited_for_and_one_never_configured_is_missing(prometheus_process):
    """The demo's verify ran 4 s after the role reloaded Prometheus and read all five targets as "not
    configured": after a reload, Prometheus lists the new targets only when its discovery manager hands
    them over (at most every 5 s). MON-001 waits for them while the configuration is that young; a target
    that no configuration names is still reported missing, without the wait once the reload is older."""
    base, first, config, proc = prometheus_process
    deadline = time.monotonic() + 60
    while health(base) == "no answer":
        assert time.monotonic() < deadline, "Prometheus never answered"
        time.sleep(0.3)
    reloaded_before = monitoring_check.last_reload(base, 2)
    second = free_port()
    server = serve_metrics(second)
    try:
        config.write_text(scrape_config(first, second))
        proc.send_signal(signal.SIGHUP)  # what Debian's unit does on `systemctl reload prometheus`
        while monitoring_check.last_reload(base, 2) == reloaded_before:
            assert time.monotonic() < deadline, "Prometheus never reloaded"
            time.sleep(0.1)
        key = f"y 127.0.0.1:{second}"
        found = monitoring_check.targets(base, [key], 5)
        assert found["up"] == [key] and found["missing"] == [], found
    finally:
        server.shutdown()
        server.server_close()
    started = time.monotonic()
    found = monitoring_check.targets(base, ["z 127.0.0.1:1"], 5, settle_s=0)
    assert found["missing"] == ["z 127.0.0.1:1"], found
    assert time.monotonic() - started < 2
