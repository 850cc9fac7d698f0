"""A no-op converge against an empty play that only gathers facts, on the same host, side by side.

    python bench/bench_converge.py [-i INVENTORY] [--rounds 3] [--playbook site.yml] [--json]

Target (issue 13): a converge that changes nothing costs at most 2x a play that gathers facts and
pings the same host. The two run alternately, --rounds times each, in one run (the box may be
busy, so neither gets a quieter moment); the verdict uses the medians. Every converge round must
report changed=0, else it was not a no-op and the run says so and exits 1.
Exit 0 within target, 1 over target or not a no-op, 2 a play failed.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
TARGET_RATIO = 2.0
EMPTY_PLAY = """---
- name: Empty play (facts and a ping only)
  hosts: gptoss_hosts
  gather_facts: true
  become: true
  tasks:
    - name: Ping
      ansible.builtin.ping:
"""


def run_play(playbook: str, inventory: str | None) -> tuple[float, dict[str, int], str]:
    """(wall seconds, recap counters summed over hosts, output) of one ansible-playbook run."""
    env = {**os.environ, "ANSIBLE_CONFIG": str(ROOT / "ansible.cfg"), "ANSIBLE_NOCOLOR": "1"}
    command = [str(ROOT / ".venv" / "bin" / "ansible-playbook"), playbook] + (["-i", inventory] if inventory else [])
    started = time.monotonic()
    proc = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True)
    seconds = time.monotonic() - started
    output = proc.stdout + proc.stderr
    if proc.returncode != 0:
        raise SystemExit(f"bench-converge: {playbook} failed (exit {proc.returncode}):\n{output[-4000:]}")
    recap: dict[str, int] = {}
    for line in re.findall(r"^\S+\s*:\s*(ok=.*)$", output, re.MULTILINE):
        for key, value in re.findall(r"(\w+)=(\d+)", line):
            recap[key] = recap.get(key, 0) + int(value)
    return seconds, recap, output


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("-i", "--inventory", help="inventory (default: ansible.cfg's, the lab)")
    parser.add_argument("--playbook", default="site.yml")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--json", action="store_true", help="also print the results as one JSON line")
    args = parser.parse_args(argv)
    with tempfile.NamedTemporaryFile("w", suffix=".yml", dir=ROOT / "playbooks", prefix=".bench-empty-") as empty:
        empty.write(EMPTY_PLAY)
        empty.flush()
        empty_times, converge_times, changed = [], [], []
        for round_number in range(1, args.rounds + 1):
            seconds, _, _ = run_play(empty.name, args.inventory)
            empty_times.append(seconds)
            seconds, recap, _ = run_play(args.playbook, args.inventory)
            converge_times.append(seconds)
            changed.append(recap.get("changed", -1))
            print(f"round {round_number}: empty play {empty_times[-1]:6.1f} s   no-op {args.playbook} "
                  f"{converge_times[-1]:6.1f} s (changed={changed[-1]})", flush=True)
    empty_median, converge_median = statistics.median(empty_times), statistics.median(converge_times)
    ratio = converge_median / empty_median
    noop = all(value == 0 for value in changed)
    verdict = "PASS" if ratio <= TARGET_RATIO and noop else "MISS"
    print(f"\nno-op converge / empty play (medians): {converge_median:.1f} s / {empty_median:.1f} s = "
          f"{ratio:.1f}x   target <= {TARGET_RATIO:g}x   {verdict}")
    if not noop:
        print(f"not a no-op: changed={changed} (converge the host first)")
    if args.json:
        print(json.dumps({"empty_s": empty_times, "converge_s": converge_times, "changed": changed,
                          "ratio": ratio, "target": TARGET_RATIO, "verdict": verdict}))
    return 0 if verdict == "PASS" else 1


if __name__ == "__main__":
    sys.exit(main())
