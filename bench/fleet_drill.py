"""The lab fleet's drill (issue 19): spread, a rolling change under load, one host's vLLM killed.

    GPTOSS_LAB=flt python bench/fleet_drill.py [--phases spread,roll,kill] [--json OUT]

Needs a converged fleet (`invoke lab.fleet-up -n 2`). The load is `python -m controller.bench` (what
`invoke bench` runs) through the router in small closed-loop batches (concurrency 2), so every
request is counted: ok or failed.
- spread: each host's own count (vllm:request_success_total on its /metrics) before and after.
- roll:   playbooks/vllm.yml over the fleet with a changed flag while the load runs; failed requests.
- kill:   kill -9 of the second host's vLLM under load: seconds until the router marks it unhealthy
          and stops sending to it (its vllm_router_processed_requests_total stops moving), failed
          requests, then seconds until systemd has it serving again and the router sends to it again.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from lab import fleet, nspawn  # noqa: E402

OUT = ROOT / ".cache" / "bench" / "fleet"


def get(url: str, timeout: float = 5.0) -> str:
    with urllib.request.urlopen(url, timeout=timeout) as response:
        return response.read().decode(errors="replace")


def metric_sum(text: str, name: str, label: str = "") -> float:
    pattern = re.compile(rf"^{re.escape(name)}(\{{[^}}]*\}})?\s+([0-9.eE+-]+)$", re.MULTILINE)
    return sum(float(value) for labels, value in pattern.findall(text) if label in (labels or ""))


class Load(threading.Thread):
    def __init__(self, url: str, tag: str):
        super().__init__(daemon=True)
        self.url, self.tag, self.batches, self.stop = url, tag, [], threading.Event()

    def run(self) -> None:
        number = 0
        while not self.stop.is_set():
            number += 1
            out = OUT / f"{self.tag}-{number}.json"
            subprocess.run([sys.executable, "-m", "controller.bench", "--base-url", self.url, "--model", "tiny-llama",
                            "--concurrency", "2", "--num-prompts", "12", "--input-len", "32", "--output-len", "16",
                            "--metrics-url", "none", "--request-timeout", "120", "--json", str(out)],
                           cwd=ROOT, capture_output=True, text=True, timeout=600)
            level = json.loads(out.read_text())["levels"][0] if out.exists() else {"completed": 0, "errors": 12}
            self.batches.append({"completed": level["completed"], "errors": level["errors"],
                                 "first_error": level.get("first_error", ""),
                                 "p50": level.get("e2el_ms", {}).get("p50"),
                                 "p95": level.get("e2el_ms", {}).get("p95")})

    def summary(self) -> dict:
        p50 = sorted(b["p50"] for b in self.batches if b["p50"] is not None)
        return {"batches": len(self.batches), "completed": sum(b["completed"] for b in self.batches),
                "failed": sum(b["errors"] for b in self.batches),
                "first_errors": [b["first_error"] for b in self.batches if b["first_error"]][:3],
                "p50_ms_median": round(p50[len(p50) // 2], 1) if p50 else None,
                "p95_ms_max": round(max((b["p95"] for b in self.batches if b["p95"] is not None), default=0), 1)}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--phases", default="spread,roll,kill")
    parser.add_argument("--json", type=Path, default=OUT / "drill.json")
    args = parser.parse_args()
    OUT.mkdir(parents=True, exist_ok=True)
    name = os.environ.get("GPTOSS_LAB", "default")
    states = [nspawn.load_state(member) for member in fleet.members(name)]
    if len(states) < 2 or None in states:
        print(f"fleet_drill: fleet {name} needs 2+ labs up (invoke lab.fleet-up -n 2)", file=sys.stderr)
        return 2
    router = f"http://{states[0].address}:8100"
    router_metrics = f"http://{states[0].address}:29000/metrics"
    workers = {s.name: f"http://{s.address}:8000" for s in states}
    report: dict = {"router": router, "workers": workers}
    phases = args.phases.split(",")

    if "spread" in phases:
        before = {n: metric_sum(get(f"{u}/metrics"), "vllm:request_success_total") for n, u in workers.items()}
        load = Load(router, "spread")
        load.start()
        time.sleep(30)
        load.stop.set()
        load.join()
        after = {n: metric_sum(get(f"{u}/metrics"), "vllm:request_success_total") for n, u in workers.items()}
        report["spread"] = {"load": load.summary(), "per_host": {n: after[n] - before[n] for n in workers}}
        print("spread:", json.dumps(report["spread"]))

    if "roll" in phases:
        load = Load(router, "roll")
        load.start()
        started = time.monotonic()
        env = {**os.environ, "ANSIBLE_CONFIG": str(ROOT / "ansible.cfg")}
        override = json.dumps({"vllm_service_flags_override": {"max-num-seqs": 3}})
        play = subprocess.run([str(ROOT / ".venv/bin/ansible-playbook"), "-i", "inventory/fleet.py",
                               "playbooks/vllm.yml", "--tags", "vllm_service", "-e", override],
                              cwd=ROOT, env=env, capture_output=True, text=True, timeout=1800)
        seconds = time.monotonic() - started
        load.stop.set()
        load.join()
        (OUT / "roll-play.txt").write_text(play.stdout + play.stderr)
        report["roll"] = {"play_rc": play.returncode, "seconds": round(seconds, 1), "load": load.summary(),
                          "drained": play.stdout.count('\\"drained\\": true') + play.stdout.count('"drained": true')}
        print("roll:", json.dumps(report["roll"]))

    if "kill" in phases:
        victim = states[1]
        url = workers[victim.name]
        label = f'worker="{url}"'
        load = Load(router, "kill")
        load.start()
        time.sleep(10)
        pid = nspawn.ssh(victim, "systemctl show -p MainPID --value gptoss-vllm").stdout.strip()
        nspawn.ssh(victim, f"kill -9 {pid}")
        killed = time.monotonic()
        out_at = stopped_at = back_at = serving_at = mark = None
        last, last_change = metric_sum(get(router_metrics), "vllm_router_processed_requests_total", label), killed
        while time.monotonic() - killed < 400:
            text = get(router_metrics)
            count = metric_sum(text, "vllm_router_processed_requests_total", label)
            healthy = metric_sum(text, "vllm_router_worker_health", label)
            now = time.monotonic()
            if count != last:
                last, last_change = count, now
            if out_at is None and healthy == 0:
                out_at, stopped_at, mark = now - killed, last_change - killed, count
            if serving_at is None:
                try:
                    if get(f"{url}/health", timeout=2) is not None:
                        serving_at = now - killed
                except OSError:
                    pass
            if mark is not None and healthy == 1 and count > mark:
                back_at = now - killed
            if back_at is not None:
                break
            time.sleep(0.5)
        time.sleep(5)
        load.stop.set()
        load.join()
        report["kill"] = {"victim": victim.name, "marked_unhealthy_s": out_at,
                          "last_request_sent_to_it_s": stopped_at, "serving_again_s": serving_at,
                          "router_sends_again_s": back_at, "load": load.summary(),
                          "restarts": nspawn.ssh(victim, "systemctl show -p NRestarts --value gptoss-vllm")
                          .stdout.strip()}
        print("kill:", json.dumps(report["kill"]))

    args.json.write_text(json.dumps(report, indent=2))
    failed = sum(report.get(p, {}).get("load", {}).get("failed", 0) for p in ("spread", "roll"))
    return 1 if failed or report.get("roll", {}).get("play_rc") else 0


if __name__ == "__main__":
    sys.exit(main())
