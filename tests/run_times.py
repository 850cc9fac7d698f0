"""Per-test wall times of every run, on record (issue 29): which tests and groups cost the suite its time.

Every pytest run writes `.cache/test-times/<UTC time>.json` and `.cache/test-times/last.json`:
each test's node id, its worker group (tests/conftest.py: xdist_group_of) and its setup + call +
teardown seconds (a session fixture's lab boot and converge count in the setup of the first test
that asks for it), plus the run's wall time and outcome counts. `invoke test-times` prints the
slowest tests and the total per group; `tests/data/test-times/` keeps the snapshot of the last full
run, committed with the change that moves it.
"""

from __future__ import annotations

import datetime
import json
import os
import time
from collections import defaultdict
from collections.abc import Iterable, Mapping
from pathlib import Path

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


class RunTimes:
    """Collects the reports (on the xdist controller, or the single process) and writes the record."""

    def __init__(self) -> None:
        self.started = time.monotonic()
        self.cpu_started = cpu_times()
        self.seconds: dict[str, float] = defaultdict(float)
        self.outcomes: dict[str, str] = {}

    def add(self, nodeid: str, when: str, duration: float, outcome: str) -> None:
        self.seconds[nodeid] += duration
        if when == "call" or outcome != "passed":  # a failed setup is the test's outcome
            self.outcomes[nodeid] = outcome if self.outcomes.get(nodeid) in (None, "passed") else self.outcomes[nodeid]

    def record(self, groups: Mapping[str, str], args: Iterable[str], exit_status: int, workers: int) -> dict:
        tests = [{"nodeid": nodeid, "group": groups.get(nodeid) or nodeid.split("::", 1)[0],
                  "seconds": round(seconds, 2), "outcome": self.outcomes.get(nodeid, "skipped")}
                 for nodeid, seconds in self.seconds.items()]
        counts: dict[str, int] = defaultdict(int)
        for test in tests:
            counts[test["outcome"]] += 1
        return {"written_at": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
                "wall_s": round(time.monotonic() - self.started, 1), "exit_status": exit_status,
                "args": list(args), "workers": workers, "cpu_busy": cpu_busy(self.cpu_started, cpu_times()),
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
    per_group: dict[str, list[float]] = defaultdict(list)
    for test in tests:
        per_group[test["group"]].append(test["seconds"])
    lines = [f"run of {record['written_at']}: wall {record['wall_s'] / 60:.1f} min, {record['workers']} workers, "
             f"exit {record['exit_status']}, "
             + (f"CPU {record['cpu_busy']:.0%} busy, " if record.get("cpu_busy") is not None else "")
             + f"{', '.join(f'{n} {k}' for k, n in sorted(record['counts'].items()))}",
             "", f"slowest {min(top, len(tests))} tests (setup + call + teardown):"]
    lines += [f"  {t['seconds']:8.1f} s  {t['outcome']:7}  {t['nodeid']}" for t in tests[:top]]
    lines += ["", "per group (sum of its tests; a group runs on one worker, in order):"]
    lines += [f"  {sum(v):8.1f} s  {len(v):4} tests  {group}"
              for group, v in sorted(per_group.items(), key=lambda item: -sum(item[1]))]
    return "\n".join(lines)
