"""One lab host, two vLLM instances behind the local router: a rolling restart under load (issue 19).

Reuses the session's converged lab: switches it to the replica profile cpu-lab-x2 with the router,
measures one `invoke bench` level through the router, then changes a flag while two counted request
loops keep running through it (tests/load_client.py): each instance is drained out of the router,
restarted behind the gate and put back. Zero failed requests is the promise. The last test goes back to
the single unit through the product (the instance units and the router are retired, nothing is cleaned
up by hand).
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest
from conftest import ROOT, Lab, record_timing, run_invoke
from load_client import Load

# In the default run (it passed twice as a drill first): ~6-8 minutes of the CI budget (replica
# converge, the roll, the way back), on a copied lab (COPIED_LAB_MODULES, tests/conftest.py).

REPLICAS = {"vllm_service_profile": "cpu-lab-x2", "router_enabled": True}
OUT = ROOT / ".cache" / "bench" / "replicas"


def bench_through(url: str) -> dict:
    """One `invoke bench` level through the router (the user's tool, and the before-figures)."""
    out = OUT / "before.json"
    proc = run_invoke("bench", "--url", url, "--model", "tiny-llama", "--concurrency", "2",
                      "--num-prompts", "12", "--input-len", "32", "--output-len", "16", "--out", str(out),
                      "--args", "--metrics-url none --request-timeout 120", timeout=600)
    assert proc.returncode == 0 and out.exists(), (proc.stdout + proc.stderr)[-3000:]
    level = json.loads(out.read_text())["levels"][0]
    return {"completed": level["completed"], "failed": level["errors"], "first_error": level.get("first_error", ""),
            "p50_ms": level.get("e2el_ms", {}).get("p50"), "p95_ms": level.get("e2el_ms", {}).get("p95")}


# During the roll: two loops through the router, each pausing after an answer (the fleet drills' load).
# Every request is counted; the pause keeps the two 1-core instances from starving the play that
# restarts them (the test's promise is zero failed requests, not the lab's peak rate).
ROLL_LOAD = {"concurrency": 2, "pause_s": 0.5, "max_tokens": 16}


@pytest.fixture(scope="module")
def replicas(lab: Lab):
    OUT.mkdir(parents=True, exist_ok=True)
    started = time.monotonic()
    result = lab.play("playbooks/vllm.yml", extra_vars=REPLICAS)
    assert result.rc == 0, result.output[-6000:]
    record_timing("replicas_converge", time.monotonic() - started)
    yield result
    # Back to the single unit through the product path, unless the last test already went there.
    if lab.ssh("ls /etc/systemd/system/gptoss-vllm@*.service", check=False).returncode == 0:
        restored = lab.play("playbooks/vllm.yml")
        assert restored.rc == 0, restored.output[-4000:]


def test_two_instances_behind_the_router_and_a_rolling_restart_under_load_fails_nothing(lab: Lab, replicas):
    address = lab.state.address
    router = f"http://{address}:8100"
    assert lab.sh("systemctl is-active gptoss-vllm@0 gptoss-vllm@1 gptoss-router").split() == ["active"] * 3
    assert lab.sh("systemctl is-active gptoss-vllm.service || true").strip() in ("inactive", "unknown")
    check = json.loads(lab.sh("PYTHONPATH=/opt/gptoss/lib python3 -m service.host.router_check"))
    assert check["ok"] and sorted(check["workers"]) == [f"http://{address}:8001", f"http://{address}:8002"], check
    pids_before = {i: lab.main_pid(f"gptoss-vllm@{i}") for i in (0, 1)}

    baseline = bench_through(router)
    assert baseline["failed"] == 0 and baseline["completed"] == 12, baseline

    with Load(router, **ROLL_LOAD) as during:
        started = time.monotonic()
        roll = lab.play("playbooks/vllm.yml", "--tags", "vllm_service",
                        extra_vars={**REPLICAS, "vllm_service_flags_override": {"max-num-seqs": 3}})
        roll_seconds = time.monotonic() - started
    record_timing("replicas_rolling_restart", roll_seconds)
    assert roll.rc == 0, roll.output[-6000:]
    load = during.summary()
    print(f"\n[replicas] before (invoke bench): {json.dumps(baseline)}\n[replicas] during the roll "
          f"({roll_seconds:.0f}s): {json.dumps(load)}")
    (OUT / "summary.json").write_text(json.dumps({"before": baseline, "during": load,
                                                  "roll_s": round(roll_seconds, 1)}, indent=2))
    # Both units restarted (new PIDs) with the new flag, one at a time, each drained out of the router first.
    for i in (0, 1):
        assert lab.main_pid(f"gptoss-vllm@{i}") != pids_before[i]
        assert "--max-num-seqs 3" in lab.sh(f"tr '\\0' ' ' < /proc/{lab.main_pid(f'gptoss-vllm@{i}')}/cmdline")
    assert roll.output.count('\\"drained\\": true') + roll.output.count('"drained": true') >= 2, roll.output[-4000:]
    assert load["requests"] > 0 and load["failed"] == 0, load
    assert json.loads(lab.sh("PYTHONPATH=/opt/gptoss/lib python3 -m service.host.router_check"))["ok"]
    Path(OUT / "roll-output.txt").write_text(roll.output)


def test_back_to_the_single_unit_removes_the_instances_and_the_router(lab: Lab, replicas):
    started = time.monotonic()
    restored = lab.play("playbooks/vllm.yml")
    record_timing("replicas_restore_single", time.monotonic() - started)
    assert restored.rc == 0, restored.output[-4000:]
    assert lab.sh("systemctl is-active gptoss-vllm.service").strip() == "active"
    for unit in ("gptoss-vllm@0.service", "gptoss-vllm@1.service", "gptoss-router.service"):
        assert lab.sh(f"systemctl is-active {unit} || true").strip() in ("inactive", "unknown"), unit
        assert lab.sh(f"systemctl show -p LoadState --value {unit}").strip() == "not-found", unit
    # (vllm_change's dated backups, *.gptoss~, stay: systemd and verify read neither.)
    left = lab.sh("ls /etc/systemd/system/gptoss-vllm@*.service /etc/systemd/system/gptoss-router.service "
                  "/etc/gptoss/vllm-args@*.json /etc/gptoss/verify.d/vllm_service@*.json "
                  "/etc/gptoss/verify.d/router.json /etc/gptoss/router.json /etc/gptoss/router-secrets.env "
                  "/var/lib/gptoss/vllm-started@*.json 2>/dev/null || true")
    assert left.strip() == "", left
    # Nothing listens on the instances' or the router's ports any more (labs share the network
    # namespace: only this lab's address counts).
    listening = lab.sh("ss -Hltn")
    address = lab.state.address
    assert not any(f"{address}:{port} " in listening for port in (8001, 8002, 8100)), listening
    # A second run changes nothing.
    again = lab.play("playbooks/vllm.yml")
    assert again.rc == 0 and again.recap["changed"] == 0, again.output[-4000:]
