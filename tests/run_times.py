"""Per-test wall times of every run, on record (issue 29): which tests and groups cost the suite its time.

Every pytest run writes `.cache/test-times/<UTC time>.json` and `.cache/test-times/last.json`:
each test's node id, its worker group (tests/conftest.py: xdist_group_of), its setup + call +
teardown seconds (a session fixture's lab boot and converge count in the setup of the first test
that asks for it) and the CPU seconds it cost - on the controller (the pytest process and the
programs it ran and waited for: ansible-playbook, invoke, ssh) and inside its worker's labs, and how many
times its labs started vLLM (each start is ~20 CPU-s in a lab, the suite's largest single cost) - plus the
run's wall time and outcome counts. The suite is CPU-bound on 2 cores (cpu_busy), so the CPU columns,
not the wall times of tests that ran side by side, say what a cut would save. `invoke test-times` prints the
slowest tests and the total per group; `tests/data/test-times/` keeps the snapshot of the last full
run, committed with the change that moves it.
"""

from __future__ import annotations

import datetime
import json
import os
import re
import resource
import subprocess
import threading
import time
from collections import defaultdict
from collections.abc import Iterable, Mapping
from pathlib import Path

# The controller's share of a play (ansible-playbook and the workers it forked): one home, the bench's too.
# controller_cpu_s below adds it to this process's own; conftest reads it as run_times.children_cpu_s.
from controller.process_cpu import children_cpu_s

TIMES_DIR = Path(__file__).resolve().parent.parent / ".cache" / "test-times"
SNAPSHOT_DIR = Path(__file__).resolve().parent / "data" / "test-times"


def cpu_times() -> tuple[int, int]:
    """(busy, total) jiffies of the whole machine since boot, from /proc/stat's first line."""
    try:
        fields = [int(value) for value in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
    except (OSError, ValueError):
        return 0, 0
    idle = fields[3] + (fields[4] if len(fields) > 4 else 0)  # idle + iowait
    return sum(fields[:8]) - idle, sum(fields[:8])


def cpu_busy(start: tuple[int, int], end: tuple[int, int]) -> float | None:
    """The share of the machine's CPU time that was busy between two readings (all processes, not only
    the suite's: whether more workers could use more of the machine, or it was already full)."""
    total = end[1] - start[1]
    return round((end[0] - start[0]) / total, 3) if total > 0 else None


# A converge that ended on the converge receipt (roles/gptoss_base) says this.
RECEIPT_HELD = "holds: inputs and managed live state unchanged"


def recap_counts(output: str) -> dict[str, int]:
    """The PLAY RECAP line's counts (ok, changed, failed, skipped, ...) of a play's output; {} without one."""
    recap = re.search(r"^\S+\s*:\s*(ok=.*)$", output, re.MULTILINE)
    return {k: int(v) for k, v in re.findall(r"(\w+)=(\d+)", recap.group(1))} if recap else {}


EXTRA_VARS_OPTIONS = ("-e", "--extra-vars")


def args_for_record(args: list[str]) -> list[str]:
    """A play's arguments as the record keeps them: each extra-vars value as "..." (a test may pass a key
    that way), every other argument cut to 60 characters."""
    kept: list[str] = []
    for arg in args:
        if kept and kept[-1] in EXTRA_VARS_OPTIONS:
            kept.append("...")
        elif arg.startswith(tuple(f"{option}=" for option in EXTRA_VARS_OPTIONS)):
            kept.append(arg.partition("=")[0] + "=...")
        else:
            kept.append(arg[:60])
    return kept


def play_record(playbook: str, args: list[str], rc: int, output: str, seconds: float, controller_s: float,
                labs_s: float) -> dict:
    """One ansible-playbook run of a test: what ran, how it ended, what it cost, and how far it went
    (tasks per the recap; `held`: ended on the receipt). The record's plays say which kind of run
    (a full converge, one ended on the receipt, a refusal) the suite pays for how often."""
    counts = recap_counts(output)
    return {"playbook": playbook, "args": args_for_record(args), "rc": rc, "seconds": round(seconds, 1),
            "cpu_controller_s": round(controller_s, 2), "cpu_labs_s": round(max(labs_s, 0.0), 2),
            "tasks": sum(counts.get(k, 0) for k in ("ok", "skipped", "failed")),  # ok counts the changed
            "changed": counts.get("changed", 0), "held": RECEIPT_HELD in " ".join(output.split())}


def mem_available_mib(meminfo: Path = Path("/proc/meminfo")) -> int | None:
    """The machine's MemAvailable in MiB (what can still be had without swapping), None where unreadable."""
    try:
        for line in meminfo.read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) // 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


class MemoryFloor:
    """The least MemAvailable seen during the run, sampled every `every_s` seconds by a daemon thread.
    CI's machine has 24 GiB and no swap: a run that came near the floor is one the kernel's OOM
    killer can fail (a vLLM worker was killed so in a run with one more lab beside it)."""

    def __init__(self, every_s: float = 2.0, read=mem_available_mib) -> None:
        self.least: int | None = None
        self.least_at: float | None = None  # epoch seconds of that sample: the record names the tests then
        self.read = read
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, args=(every_s,), daemon=True, name="memory-floor")

    def sample(self) -> None:
        value = self.read()
        if value is not None and (self.least is None or value < self.least):
            self.least, self.least_at = value, time.time()

    def _run(self, every_s: float) -> None:
        while not self._stop.is_set():
            self.sample()
            self._stop.wait(every_s)

    def start(self) -> MemoryFloor:
        self._thread.start()
        return self

    def stop(self) -> int | None:
        self._stop.set()
        self.sample()
        return self.least


def controller_cpu_s() -> float:
    """CPU seconds of this process and of the children it has waited for (subprocess.run waits)."""
    own = resource.getrusage(resource.RUSAGE_SELF)
    return own.ru_utime + own.ru_stime + children_cpu_s()


def labs_cpu_s(lab_name: str, proc: Path = Path("/proc")) -> float:
    """CPU seconds so far of the labs named `lab_name` or `lab_name-*` (a worker's lab, its copy, its
    trixie and bare labs): every live process of theirs (systemd cgroup /gptoss-lab-<name>, as
    lab/nspawn.py starts them), its own time plus that of the children it reaped. A process that
    ended was reaped by one that lives (the container's systemd reaps its services and orphans), so
    each CPU second is counted once, while the lab runs."""
    pattern = re.compile(rf"^(?:0:|\d+:name=systemd):/gptoss-lab-{re.escape(lab_name)}(?:[-/]|$)", re.MULTILINE)
    ticks = 0
    for entry in proc.iterdir():
        if not entry.name.isdigit():
            continue
        try:
            if not pattern.search((entry / "cgroup").read_text()):
                continue
            fields = (entry / "stat").read_text().rpartition(")")[2].split()
        except OSError:  # ended while read
            continue
        ticks += sum(int(value) for value in fields[11:15])  # utime stime cutime cstime
    return ticks / os.sysconf("SC_CLK_TCK")


# A vLLM start costs ~20 CPU-s in a lab (three processes, each importing torch and vLLM): a test phase that
# cost less than this in all started none, so the journal is read only for the phases that may have.
VLLM_START_MIN_CPU_S = 4.0


def lab_journal_dirs(labs_dir: Path, lab_name: str) -> list[Path]:
    """The persistent journal folders of the labs named `lab_name` or `lab_name-*` (as labs_cpu_s counts
    them): each lab's rootfs is a folder on the controller, so its journal is read without ssh."""
    return sorted(path for lab in labs_dir.glob(f"{lab_name}*")
                  if lab.name == lab_name or lab.name.startswith(f"{lab_name}-")
                  for path in (lab / "rootfs" / "var" / "log" / "journal").glob("*") if path.is_dir())


def count_vllm_starts(journal_text: str, since_epoch: float) -> int:
    """Starts of a gptoss-vllm unit (gptoss-vllm, gptoss-vllm@N) in `journalctl -o short-unix` text at or
    after `since_epoch`: the line systemd writes as it starts one ("Starting gptoss-vllm..."), so a
    restart after a crash counts, and a start that failed counts too (its imports cost the same)."""
    count = 0
    for line in journal_text.splitlines():
        stamp, _, rest = line.partition(" ")
        try:
            when = float(stamp)
        except ValueError:
            continue
        writer, _, message = rest.partition(": ")  # "<host> systemd[1]", the unit's start as PID 1 logs it
        if when >= since_epoch and writer.endswith(" systemd[1]") and message.startswith("Starting gptoss-vllm"):
            count += 1
    return count


def vllm_starts(journal_dirs: Iterable[Path], since_epoch: float) -> int:
    """How many times the labs whose journals are given started vLLM since `since_epoch`. A lab taken
    down in the meantime is gone with its journal: its starts are not counted."""
    count = 0
    for directory in journal_dirs:
        try:
            out = subprocess.run(["journalctl", "-D", str(directory), "-u", "gptoss-vllm*", "--since",
                                  f"@{int(since_epoch)}", "-o", "short-unix", "--no-pager", "-q"],
                                 capture_output=True, text=True, timeout=60, check=False).stdout
        except (OSError, subprocess.TimeoutExpired):
            continue
        count += count_vllm_starts(out, since_epoch)
    return count


def split_phase_cpu(controller_delta: float, labs_before: float, labs_after: float) -> tuple[float, float]:
    """(controller, labs) CPU seconds of one phase from the two readings of each.

    A lab stopped in the phase (taken down, or restarted: a new container starts from 0) takes its
    lifetime CPU out of the labs' reading - and, when this process had started it (nspawn is then its
    child), into this process's reaped children, the controller's reading. That moved share is taken
    back out of the controller so no second is counted twice. (A lab booted and stopped within one
    phase never shows in the labs' readings: its CPU counts as the controller's.)"""
    vanished = max(labs_before - labs_after, 0.0)
    return max(controller_delta - vanished, 0.0), max(labs_after - labs_before, 0.0)


class RunTimes:
    """Collects the reports (on the xdist controller, or the single process) and writes the record."""

    def __init__(self) -> None:
        self.started = time.monotonic()
        self.cpu_started = cpu_times()
        self.seconds: dict[str, float] = defaultdict(float)
        self.cpu: dict[str, list[float]] = defaultdict(lambda: [0.0, 0.0])  # controller, labs
        self.outcomes: dict[str, str] = {}
        self.plays: dict[str, list[dict]] = defaultdict(list)
        self.vllm_starts: dict[str, int] = defaultdict(int)
        # Where and when each test ran: its xdist worker, and the epoch seconds of its first phase's start
        # and last phase's end (pytest's report.start/stop), for the per-worker timeline.
        self.started_epoch = time.time()
        self.workers: dict[str, str] = {}
        self.spans: dict[str, list[float]] = {}
        self.memory = MemoryFloor().start()

    def add(self, nodeid: str, when: str, duration: float, outcome: str,
            cpu: tuple[float, float] = (0.0, 0.0), plays: Iterable[dict] = (),
            worker: str = "", span: tuple[float, float] | None = None, vllm_starts: int = 0) -> None:
        self.seconds[nodeid] += duration
        self.vllm_starts[nodeid] += vllm_starts
        if worker:
            self.workers[nodeid] = worker
        if span is not None:
            known = self.spans.setdefault(nodeid, [span[0], span[1]])
            known[0], known[1] = min(known[0], span[0]), max(known[1], span[1])
        self.plays[nodeid] += plays
        self.cpu[nodeid][0] += cpu[0]
        self.cpu[nodeid][1] += cpu[1]
        if when == "call" or outcome != "passed":  # a failed setup is the test's outcome
            self.outcomes[nodeid] = outcome if self.outcomes.get(nodeid) in (None, "passed") else self.outcomes[nodeid]

    def record(self, groups: Mapping[str, str], args: Iterable[str], exit_status: int, workers: int) -> dict:
        tests = [{"nodeid": nodeid, "group": groups.get(nodeid) or nodeid.split("::", 1)[0],
                  "seconds": round(seconds, 2), "outcome": self.outcomes.get(nodeid, "skipped"),
                  "cpu_controller_s": round(self.cpu[nodeid][0], 2), "cpu_labs_s": round(self.cpu[nodeid][1], 2),
                  **({"worker": self.workers[nodeid]} if nodeid in self.workers else {}),
                  **({"start_s": round(self.spans[nodeid][0] - self.started_epoch, 1),
                      "end_s": round(self.spans[nodeid][1] - self.started_epoch, 1)} if nodeid in self.spans else {}),
                  **({"vllm_starts": self.vllm_starts[nodeid]} if self.vllm_starts[nodeid] else {}),
                  **({"plays": self.plays[nodeid]} if self.plays[nodeid] else {})}
                 for nodeid, seconds in self.seconds.items()]
        counts: dict[str, int] = defaultdict(int)
        for test in tests:
            counts[test["outcome"]] += 1
        return {"written_at": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
                "wall_s": round(time.monotonic() - self.started, 1), "exit_status": exit_status,
                "args": list(args), "workers": workers, "cpu_busy": cpu_busy(self.cpu_started, cpu_times()),
                "mem_available_min_mib": self.memory.stop(),
                **({"mem_available_min_at_s": round(self.memory.least_at - self.started_epoch, 1)}
                   if self.memory.least_at is not None else {}),
                "counts": dict(counts), "tests": sorted(tests, key=lambda t: -t["seconds"])}

    def write(self, record: dict, directory: Path = TIMES_DIR) -> Path:
        directory.mkdir(parents=True, exist_ok=True)
        target = directory / f"{record['written_at'].replace(':', '')}.json"
        text = json.dumps(record, indent=1) + "\n"
        target.write_text(text)
        tmp = directory / "last.json.tmp"
        tmp.write_text(text)
        os.replace(tmp, directory / "last.json")
        return target


def summary(record: Mapping, top: int = 15) -> str:
    """The slowest `top` tests and the total per group, as text."""
    tests = record["tests"]
    per_group: dict[str, list[Mapping]] = defaultdict(list)
    for test in tests:
        per_group[test["group"]].append(test)
    lines = [f"run of {record['written_at']}: wall {record['wall_s'] / 60:.1f} min, {record['workers']} workers, "
             f"exit {record['exit_status']}, "
             + (f"CPU {record['cpu_busy']:.0%} busy, " if record.get("cpu_busy") is not None else "")
             + (f"least memory available {record['mem_available_min_mib']} MiB, "
                if record.get("mem_available_min_mib") is not None else "")
             + f"{', '.join(f'{n} {k}' for k, n in sorted(record['counts'].items()))}",
             "", f"slowest {min(top, len(tests))} tests (setup + call + teardown):"]
    lines += [f"  {t['seconds']:8.1f} s  {t['outcome']:7}  {t['nodeid']}" for t in tests[:top]]
    has_cpu = any("cpu_labs_s" in t for t in tests)  # records before the CPU columns have none

    def total(group_tests: list[Mapping], key: str) -> float:
        return sum(t.get(key, 0.0) for t in group_tests)

    def starts(group_tests: list[Mapping]) -> str:  # records before session 22 kept no count
        count = int(total(group_tests, "vllm_starts"))
        return f"  ({count} vLLM start{'s' if count != 1 else ''})" if count else ""

    if has_cpu:
        by_cpu = sorted(tests, key=lambda t: -(t["cpu_controller_s"] + t["cpu_labs_s"]))[:top]
        lines += ["", f"most CPU {len(by_cpu)} tests (controller + labs):"]
        lines += [f"  {t['cpu_controller_s'] + t['cpu_labs_s']:8.1f} s  ({t['cpu_controller_s']:.1f} + "
                  f"{t['cpu_labs_s']:.1f})  {t['nodeid']}{starts([t])}" for t in by_cpu]
    lines += ["", "per group (sum of its tests; a group runs on one worker, in order)"
              + (": wall, then CPU on the controller + in the labs" if has_cpu else ":")]
    lines += [f"  {total(v, 'seconds'):8.1f} s  {len(v):4} tests  "
              + (f"CPU {total(v, 'cpu_controller_s'):7.1f} + {total(v, 'cpu_labs_s'):7.1f} s  " if has_cpu else "")
              + group + starts(v)
              for group, v in sorted(per_group.items(), key=lambda item: -total(item[1], "seconds"))]
    plays = [play for test in tests for play in test.get("plays", [])]
    if plays:
        lines += ["", "ansible-playbook runs of the lab tests (count, wall, CPU on the controller + in the lab):"]
        for kind, chosen in (("ended on the receipt", [p for p in plays if p["held"]]),
                             ("rc != 0 (refused or failed)", [p for p in plays if p["rc"] != 0]),
                             ("ran to the end, 150+ tasks", [p for p in plays
                                                             if not p["held"] and p["rc"] == 0 and p["tasks"] >= 150]),
                             ("ran to the end, fewer tasks", [p for p in plays
                                                              if not p["held"] and p["rc"] == 0 and p["tasks"] < 150])):
            lines.append(f"  {len(chosen):4}  {total(chosen, 'seconds'):8.1f} s  "
                         f"CPU {total(chosen, 'cpu_controller_s'):7.1f} + {total(chosen, 'cpu_labs_s'):7.1f} s  {kind}")
    if has_cpu:
        lines.append(f"  all: CPU {total(tests, 'cpu_controller_s'):.0f} s on the controller + "
                     f"{total(tests, 'cpu_labs_s'):.0f} s in the labs{starts(tests)}")
    lines += worker_timeline(tests, record["wall_s"])
    lines += memory_floor_tests(tests, record.get("mem_available_min_at_s"), record.get("mem_available_min_mib"))
    return "\n".join(lines)


def memory_floor_tests(tests: list[Mapping], at_s: float | None, least_mib: int | None) -> list[str]:
    """The tests that were running when the run's least memory was seen: what to look at first when the
    floor comes near zero (CI's machine has no swap). Empty for records without the moment."""
    if at_s is None:
        return []
    running = sorted((t for t in tests if "start_s" in t and t["start_s"] <= at_s <= t["end_s"]),
                     key=lambda t: t.get("worker", ""))
    return (["", f"running at {at_s / 60:.1f} min, when the least memory ({least_mib} MiB) was seen:"]
            + [f"  {t.get('worker', 'main'):5} {t['nodeid']}" for t in running])


def worker_timeline(tests: list[Mapping], wall_s: float) -> list[str]:
    """Each worker's groups in the order it ran them (when each started, its span, its CPU) and how long
    the worker had nothing left before the run ended: what the scheduler did, and what a copied lab
    inherited from the group before it on the same worker. Empty for records without start times."""
    runs: dict[str, dict[str, list[Mapping]]] = defaultdict(lambda: defaultdict(list))
    for test in tests:
        if "start_s" in test:
            runs[test.get("worker") or "main"][test["group"]].append(test)
    if not runs:
        return []
    lines = ["", "per worker, its groups in the order they ran (start, span, CPU controller + labs):"]
    for worker in sorted(runs):
        spans = sorted(((min(t["start_s"] for t in group_tests), max(t["end_s"] for t in group_tests), group,
                         sum(t.get("cpu_controller_s", 0.0) + t.get("cpu_labs_s", 0.0) for t in group_tests))
                        for group, group_tests in runs[worker].items()))
        # [start, end, lab group or "", CPU, modules]: modules without a lab that ran one after another are one row.
        rows: list[list] = []
        for start, end, group, cpu in spans:
            lab = group if group.startswith("lab-") else ""
            if rows and not lab and not rows[-1][2]:
                rows[-1][1], rows[-1][3], rows[-1][4] = end, rows[-1][3] + cpu, rows[-1][4] + 1
            else:
                rows.append([start, end, lab, cpu, 1])
        lines += [f"  {worker:5} {start / 60:6.1f} min  {end - start:7.1f} s  CPU {cpu:7.1f} s  "
                  + (lab or f"{modules} module{'s' if modules > 1 else ''} without a lab")
                  for start, end, lab, cpu, modules in rows]
        lines.append(f"  {worker:5} idle for the last {max(wall_s - spans[-1][1], 0.0) / 60:.1f} min of the run")
    return lines
