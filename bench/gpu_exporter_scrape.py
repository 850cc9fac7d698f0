"""What one scrape of gptoss-gpu-exporter costs: wall time per scrape and the exporter's CPU seconds per scrape.

Starts the real exporter (``python -m service.venv.gpu_exporter``) on a port, scrapes its /metrics N times over
HTTP and reads the exporter's own CPU time from /proc/<pid>/stat before and after. ``--dump`` also prints the
full /metrics text of the last scrape, the families served (and those declared but not served) and the fields
each GPU reports unsupported. Needs only prometheus-client and nvidia-ml-py beside this checkout:

    python3 bench/gpu_exporter_scrape.py --port 9835 --scrapes 50 --dump
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from prometheus_client.parser import text_string_to_metric_families  # noqa: E402

from service.venv.gpu_exporter import FAMILIES  # noqa: E402

TICKS = os.sysconf("SC_CLK_TCK")


def cpu_seconds(pid: int) -> float:
    """utime + stime of a process (fields 14 and 15 of /proc/PID/stat, after the command's parentheses)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / TICKS


def scrape(url: str, timeout: float = 10.0) -> bytes:
    with urllib.request.urlopen(url, timeout=timeout) as response:
        return response.read()


def wait_ready(url: str, proc: subprocess.Popen, timeout: float) -> float:
    started = time.monotonic()
    while time.monotonic() - started < timeout:
        if proc.poll() is not None:
            raise SystemExit(f"the exporter exited with {proc.returncode} before serving:\n{proc.stderr.read()}")
        try:
            scrape(url, timeout=2.0)
            return time.monotonic() - started
        except (urllib.error.URLError, ConnectionError, TimeoutError):
            time.sleep(0.1)
    raise SystemExit(f"the exporter did not answer {url} within {timeout:g} s")


def summary(text: str) -> dict:
    """Families served (with their series counts), declared-but-absent ones, unsupported fields, NVML state."""
    served: dict[str, int] = {}
    unsupported: dict[str, list[str]] = {}
    nvml: dict[str, object] = {}
    for fam in text_string_to_metric_families(text):
        for sample in fam.samples:
            served[fam.name] = served.get(fam.name, 0) + 1
            if fam.name == "gptoss_gpu_field_unsupported_info":
                gpu = f"GPU {sample.labels['gpu']} ({sample.labels['name']})"
                unsupported.setdefault(gpu, []).append(sample.labels["field"])
            elif fam.name in ("gptoss_nvml_up", "gptoss_gpu_count"):
                nvml[fam.name] = sample.value
            elif fam.name == "gptoss_nvml_error_info":
                nvml["reason"] = sample.labels["reason"]
    # The parser names counters without _total; the contract names them as PromQL sees them.
    declared = {f.name: f.name.removesuffix("_total") if f.kind == "counter" else f.name for f in FAMILIES}
    return {"nvml": nvml,
            "served": {name: served[key] for name, key in declared.items() if key in served},
            "declared_not_served": [name for name, key in declared.items() if key not in served],
            "other_served": sorted(k for k in served if k not in declared.values()),
            "unsupported_fields": unsupported}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--port", type=int, default=9835)
    parser.add_argument("--scrapes", type=int, default=50)
    parser.add_argument("--python", default=sys.executable, help="interpreter that runs the exporter")
    parser.add_argument("--dump", action="store_true", help="print the /metrics text and the families served")
    parser.add_argument("--json", metavar="FILE", help="also write the numbers and the summary as JSON")
    args = parser.parse_args(argv)
    if args.scrapes < 1:
        parser.error("--scrapes must be at least 1")
    url = f"http://127.0.0.1:{args.port}/metrics"
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]).rstrip(":"))
    proc = subprocess.Popen([args.python, "-m", "service.venv.gpu_exporter", "--port", str(args.port),
                             "--listen-address", "127.0.0.1"],
                            cwd=ROOT, env=env, stderr=subprocess.PIPE, text=True)
    try:
        ready_s = wait_ready(url, proc, 60.0)
        first_start = time.perf_counter()
        scrape(url)
        first_s = time.perf_counter() - first_start
        times, sizes = [], []
        cpu_before = cpu_seconds(proc.pid)
        for _ in range(args.scrapes):
            start = time.perf_counter()
            body = scrape(url)
            times.append(time.perf_counter() - start)
            sizes.append(len(body))
        cpu_after = cpu_seconds(proc.pid)
        text = body.decode()
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            rc = proc.wait(timeout=15)
        except subprocess.TimeoutExpired:
            proc.kill()
            rc = proc.wait()
        log = proc.stderr.read()
    info = summary(text)
    result = {
        "scrapes": args.scrapes, "ready_s": round(ready_s, 3), "first_scrape_ms": round(first_s * 1000, 2),
        "scrape_ms": {"median": round(statistics.median(times) * 1000, 2),
                      "p95": round(sorted(times)[max(0, int(len(times) * 0.95) - 1)] * 1000, 2),
                      "min": round(min(times) * 1000, 2), "max": round(max(times) * 1000, 2),
                      "mean": round(statistics.fmean(times) * 1000, 2)},
        "exporter_cpu_ms_per_scrape": round((cpu_after - cpu_before) / args.scrapes * 1000, 3),
        "exporter_cpu_s_total": round(cpu_after - cpu_before, 3), "clock_ticks_per_s": TICKS,
        "bytes_per_scrape": sizes[-1], "exporter_exit_code": rc, **info,
    }
    print(f"exporter: NVML {info['nvml']}; ready after {ready_s:.2f} s; first scrape {result['first_scrape_ms']} ms")
    print(f"{args.scrapes} scrapes: median {result['scrape_ms']['median']} ms, p95 {result['scrape_ms']['p95']} ms, "
          f"min {result['scrape_ms']['min']} ms, max {result['scrape_ms']['max']} ms; "
          f"exporter CPU {result['exporter_cpu_ms_per_scrape']} ms per scrape "
          f"({result['exporter_cpu_s_total']} s over {args.scrapes}, {TICKS} ticks/s); {sizes[-1]} bytes per scrape")
    if args.dump:
        print("\n---- /metrics (last scrape) ----")
        print(text, end="")
        print("---- families served (series) ----")
        for name, count in info["served"].items():
            print(f"{name} {count}")
        print("---- declared but not served ----")
        print("\n".join(info["declared_not_served"]) or "(none)")
        print("---- fields reported unsupported ----")
        for gpu, fields in info["unsupported_fields"].items():
            print(f"{gpu}: {', '.join(sorted(fields))}")
        if not info["unsupported_fields"]:
            print("(none)")
        print("---- exporter log ----")
        print(log, end="")
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2) + "\n")
    print(f"exporter exit code after SIGTERM: {rc}")
    return 0 if rc == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
