"""A no-op converge against an empty play that only gathers facts, on the same host, side by side.

    python bench/bench_converge.py [-i INVENTORY] [--rounds 3] [--playbook site.yml] [--floor-calls 20] [--json]
                                   [--strategies gptoss.host.mitogen_linear,linear]

Target (issue 13): a converge that changes nothing costs at most 2x a play that gathers facts and
pings the same host. Each round runs, alternately (the box may be busy, so none gets a quieter
moment): the empty play; the no-op converge as users run it (ended by the converge receipt: same
inputs, same managed live state); the same converge with the receipt switched off
(-e gptoss_base_receipt=false: every role runs and finds nothing to do), for reference and for the
slowest-task list. The verdict uses the medians of the first two. A warm-up converge first makes
sure the receipt is there; every timed converge must report changed=0, and the receipt's run must
say the receipt held, else the run says so and exits 1. Each round also times a play of 1 and of
1+N trivial module calls (--floor-calls): their difference over N is what one module call costs.
With --strategies A,B each round also runs the receipt-off converge under each Ansible strategy (the
order alternating per round) and prints its wall and controller CPU seconds, and the ratio of the
medians: what ansible.cfg's Mitogen strategy saves against Ansible's own `linear` (docs/design.md).
Exit 0 within target, 1 over target or not a no-op, 2 a play failed.
"""

from __future__ import annotations

import argparse
import contextlib
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
sys.path.insert(0, str(ROOT))

from controller.process_cpu import children_cpu_s  # noqa: E402 - after ROOT joins the path

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


def floor_play(calls: int) -> str:
    """A play of `calls` trivial module calls (stat, as root, no facts): what one module call costs
    here, whatever it does; the 2x budget divided by it is how many calls a no-op can make."""
    tasks = "".join(f"""    - name: Stat {number}
      ansible.builtin.stat:
        path: /etc/hostname
""" for number in range(calls))
    return f"""---
- name: Module-call floor ({calls} calls)
  hosts: gptoss_hosts
  gather_facts: false
  become: true
  tasks:
{tasks}"""


RECEIPT_HELD = "holds: inputs and managed live state unchanged, nothing to do"
RECEIPT_OFF = ["-e", "gptoss_base_receipt=false"]


def run_play(playbook: str, inventory: str | None, task_times: Path | None = None,
             extra: list[str] | None = None, strategy: str = "") -> tuple[float, dict[str, int], str]:
    """(wall seconds, recap counters summed over hosts, output) of one ansible-playbook run; with
    task_times, the collection's task_times callback writes each task's seconds there; with strategy,
    that Ansible strategy instead of ansible.cfg's."""
    env = {**os.environ, "ANSIBLE_CONFIG": str(ROOT / "ansible.cfg"), "ANSIBLE_NOCOLOR": "1"}
    if strategy:
        env["ANSIBLE_STRATEGY"] = strategy
    if task_times is not None:
        env.update(ANSIBLE_CALLBACKS_ENABLED="gptoss.host.task_times", GPTOSS_TASK_TIMES=str(task_times))
    command = [str(ROOT / ".venv" / "bin" / "ansible-playbook"), playbook] + (["-i", inventory] if inventory else [])
    command += extra or []
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


def compare_strategies(strategies: list[str], rounds: int, playbook: str, inventory: str | None) -> None:
    """The receipt-off converge under each strategy, alternating which goes first, side by side."""
    results: dict[str, list[tuple[float, float]]] = {name: [] for name in strategies}
    for round_number in range(1, rounds + 1):
        order = strategies if round_number % 2 else list(reversed(strategies))
        for name in order:
            cpu_before = children_cpu_s()
            seconds, recap, _ = run_play(playbook, inventory, extra=RECEIPT_OFF, strategy=name)
            results[name].append((seconds, children_cpu_s() - cpu_before))
            if recap.get("changed", -1) != 0:
                raise SystemExit(f"bench-converge: {name}: changed={recap.get('changed')}, not a no-op")
            print(f"round {round_number}: receipt off under {name}: {seconds:6.1f} s wall, "
                  f"{results[name][-1][1]:5.1f} s controller CPU", flush=True)
    medians = {name: (statistics.median(w for w, _ in rows), statistics.median(c for _, c in rows))
               for name, rows in results.items()}
    first, *others = strategies
    for name in others:
        print(f"receipt-off converge, {first} / {name} (medians): wall {medians[first][0]:.1f} / "
              f"{medians[name][0]:.1f} s = {medians[first][0] / medians[name][0]:.2f}x, controller CPU "
              f"{medians[first][1]:.1f} / {medians[name][1]:.1f} s = {medians[first][1] / medians[name][1]:.2f}x")


def print_slowest_tasks(rounds: list[list[dict]], top: int) -> None:
    """The no-op converge's slowest tasks, median seconds over the rounds: where the ratio goes."""
    per_task: dict[str, list[float]] = {}
    for rows in rounds:
        for row in rows:
            per_task.setdefault(row["task"], []).append(row["seconds"])
    if not per_task:
        return
    medians = sorted(((statistics.median(v), k) for k, v in per_task.items()), reverse=True)
    total = sum(m for m, _ in medians)
    print(f"\nslowest of the receipt-off no-op's {len(medians)} tasks (median s over the rounds; "
          f"all tasks {total:.1f} s):")
    for seconds, name in medians[:top]:
        print(f"  {seconds:6.2f}  {name}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("-i", "--inventory", help="inventory (default: ansible.cfg's, the lab)")
    parser.add_argument("--playbook", default="site.yml")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--json", action="store_true", help="also print the results as one JSON line")
    parser.add_argument("--top", type=int, default=12, help="how many of the no-op's slowest tasks to list")
    parser.add_argument("--floor-calls", type=int, default=20,
                        help="also time plays of 1 and 1+N trivial module calls, for the cost of one call (0: off)")
    parser.add_argument("--strategies", default="",
                        help="two or more Ansible strategies, comma-separated: the receipt-off converge under each")
    args = parser.parse_args(argv)
    with contextlib.ExitStack() as stack:
        empty, floor_one, floor_many = (
            stack.enter_context(tempfile.NamedTemporaryFile("w", suffix=".yml", dir=ROOT / "playbooks",
                                                            prefix=f".bench-{name}-"))
            for name in ("empty", "floor-1", "floor-n"))
        for handle, text in ((empty, EMPTY_PLAY), (floor_one, floor_play(1)),
                             (floor_many, floor_play(1 + args.floor_calls))):
            handle.write(text)
            handle.flush()
        _, recap, _ = run_play(args.playbook, args.inventory)  # warm-up: writes the receipt if it is missing
        if recap.get("changed", -1) != 0:
            print(f"warm-up converge changed={recap.get('changed')}: not a no-op (converge the host first)")
            return 1
        empty_times, converge_times, full_times, changed, call_costs = [], [], [], [], []
        held: list[bool] = []
        task_seconds: list[list[dict]] = []
        for round_number in range(1, args.rounds + 1):
            seconds, _, _ = run_play(empty.name, args.inventory)
            empty_times.append(seconds)
            if args.floor_calls > 0:
                one, _, _ = run_play(floor_one.name, args.inventory)
                many, _, _ = run_play(floor_many.name, args.inventory)
                call_costs.append((many - one) / args.floor_calls)
            seconds, recap, output = run_play(args.playbook, args.inventory)
            converge_times.append(seconds)
            held.append(RECEIPT_HELD in " ".join(output.split()))  # the YAML callback folds long lines
            changed.append(recap.get("changed", -1))
            times_file = Path(empty.name).with_suffix(f".times-{round_number}.json")
            seconds, recap, _ = run_play(args.playbook, args.inventory, times_file, RECEIPT_OFF)
            full_times.append(seconds)
            task_seconds.append(json.loads(times_file.read_text()) if times_file.exists() else [])
            times_file.unlink(missing_ok=True)
            changed.append(recap.get("changed", -1))
            floor = f"   one module call {call_costs[-1]:.2f} s" if call_costs else ""
            print(f"round {round_number}: empty play {empty_times[-1]:6.1f} s   no-op {args.playbook} "
                  f"{converge_times[-1]:6.1f} s (receipt {'held' if held[-1] else 'DID NOT HOLD'})   "
                  f"receipt off {full_times[-1]:6.1f} s   changed={changed[-2:]}{floor}", flush=True)
    empty_median, converge_median = statistics.median(empty_times), statistics.median(converge_times)
    full_median = statistics.median(full_times)
    ratio = converge_median / empty_median
    noop = all(value == 0 for value in changed) and all(held)
    verdict = "PASS" if ratio <= TARGET_RATIO and noop else "MISS"
    print(f"\nno-op converge / empty play (medians): {converge_median:.1f} s / {empty_median:.1f} s = "
          f"{ratio:.1f}x   target <= {TARGET_RATIO:g}x   {verdict}")
    print(f"receipt off (every role runs, finds nothing): {full_median:.1f} s = {full_median / empty_median:.1f}x")
    if not noop:
        print(f"not a no-op ended by the receipt: changed={changed}, receipt held={held}")
    if call_costs:
        per_call = statistics.median(call_costs)
        print(f"one module call (stat as root, median): {per_call:.2f} s; the receipt-off no-op is "
              f"{full_median / per_call:.0f} such calls, the 2x budget ({TARGET_RATIO * empty_median:.1f} s) "
              f"{TARGET_RATIO * empty_median / per_call:.0f}")
    print_slowest_tasks(task_seconds, args.top)
    if args.strategies:
        print()
        compare_strategies(args.strategies.split(","), args.rounds, args.playbook, args.inventory)
    if args.json:
        print(json.dumps({"empty_s": empty_times, "converge_s": converge_times, "receipt_off_s": full_times,
                          "receipt_held": held, "changed": changed,
                          "module_call_s": call_costs, "ratio": ratio, "target": TARGET_RATIO, "verdict": verdict}))
    return 0 if verdict == "PASS" else 1


if __name__ == "__main__":
    sys.exit(main())
