"""The per-test time record (tests/run_times.py): what `invoke test-times` prints from."""

from __future__ import annotations

import json
import os

import run_times


def test_a_run_is_recorded_per_test_and_summed_per_group(tmp_path):
    times = run_times.RunTimes()
    for when, seconds in (("setup", 120.0), ("call", 30.0), ("teardown", 1.5)):
        times.add("tests/test_a.py::test_lab", when, seconds, "passed")
    times.add("tests/test_b.py::test_unit", "call", 0.25, "passed")
    times.add("tests/test_b.py::test_broken", "setup", 2.0, "failed")
    record = times.record({"tests/test_a.py::test_lab": "lab-bookworm"}, ["-n", "2"], 1, 2)
    written = times.write(record, tmp_path)
    assert json.loads((tmp_path / "last.json").read_text()) == json.loads(written.read_text()) == record
    assert [t["nodeid"] for t in record["tests"]] == [
        "tests/test_a.py::test_lab", "tests/test_b.py::test_broken", "tests/test_b.py::test_unit"]
    assert record["tests"][0] == {"nodeid": "tests/test_a.py::test_lab", "group": "lab-bookworm",
                                  "seconds": 151.5, "outcome": "passed", "cpu_controller_s": 0.0,
                                  "cpu_labs_s": 0.0}
    assert record["counts"] == {"passed": 2, "failed": 1}
    text = run_times.summary(record, top=2)
    assert "151.5 s  passed   tests/test_a.py::test_lab" in text and "test_unit" not in text.split("per group")[0]
    assert "151.5 s     1 tests  CPU     0.0 +     0.0 s  lab-bookworm" in text
    assert "2.2 s     2 tests  CPU     0.0 +     0.0 s  tests/test_b.py" in text
    old = {**record, "tests": [{k: v for k, v in t.items() if not k.startswith("cpu_")} for t in record["tests"]]}
    assert "151.5 s     1 tests  lab-bookworm" in run_times.summary(old)  # a record from before the CPU columns


def test_cpu_is_recorded_per_test_and_summed_per_group(tmp_path):
    times = run_times.RunTimes()
    times.add("tests/test_a.py::test_lab", "setup", 100.0, "passed", (40.0, 90.0))
    times.add("tests/test_a.py::test_lab", "call", 10.0, "passed", (2.5, 7.5))
    times.add("tests/test_b.py::test_unit", "call", 1.0, "passed", (1.0, 0.0))
    record = times.record({"tests/test_a.py::test_lab": "lab-bookworm"}, [], 0, 2)
    assert record["tests"][0]["cpu_controller_s"] == 42.5 and record["tests"][0]["cpu_labs_s"] == 97.5
    text = run_times.summary(record, top=5)
    assert "140.0 s  (42.5 + 97.5)  tests/test_a.py::test_lab" in text
    assert "CPU    42.5 +    97.5 s  lab-bookworm" in text
    assert "all: CPU 44 s on the controller + 98 s in the labs" in text


def test_labs_cpu_counts_the_named_labs_live_and_reaped_time(tmp_path):
    """Read the way /proc shows it: the lab's processes by their systemd cgroup, utime stime cutime
    cstime (fields 14-17) each; another lab whose name only starts the same is not counted."""
    tick = os.sysconf("SC_CLK_TCK")

    def process(pid: int, cgroup: str, ticks: tuple[int, int, int, int], comm: str = "python3") -> None:
        entry = tmp_path / str(pid)
        entry.mkdir()
        (entry / "cgroup").write_text(f"9:name=systemd:{cgroup}\n1:cpu:/\n0::{cgroup}\n")
        (entry / "stat").write_text(f"{pid} ({comm}) S 1 1 1 0 -1 0 0 0 0 0 {' '.join(map(str, ticks))} 20 0\n")

    process(10, "/gptoss-lab-pytest-gw0/supervisor", (tick, 0, 0, 0))
    process(11, "/gptoss-lab-pytest-gw0/payload/init.scope", (tick, tick, 3 * tick, tick), comm="sys temd) x")
    process(12, "/gptoss-lab-pytest-gw0-copy/payload/system.slice/gptoss-vllm.service", (2 * tick, 0, 0, 0))
    process(13, "/gptoss-lab-pytest-gw01/payload", (50 * tick, 0, 0, 0))  # another worker's lab
    process(14, "/user.slice", (70 * tick, 0, 0, 0))
    (tmp_path / "self").mkdir()
    assert run_times.labs_cpu_s("pytest-gw0", tmp_path) == 1 + 6 + 2
    assert run_times.labs_cpu_s("pytest-gw0-copy", tmp_path) == 2


def test_a_stopped_labs_cpu_is_not_counted_again_on_the_controller():
    # 600 s of lab CPU reaped into the controller's children when the lab went down in this phase.
    assert run_times.split_phase_cpu(612.0, 600.0, 0.0) == (12.0, 0.0)
    assert run_times.split_phase_cpu(30.0, 100.0, 140.0) == (30.0, 40.0)  # a lab that ran on
    assert run_times.split_phase_cpu(5.0, 600.0, 20.0) == (0.0, 0.0)  # started by another process


def test_each_play_of_a_lab_test_is_kept_with_its_kind_and_cost():
    """Lab.play's record of one ansible-playbook run: its recap's task count, whether it ended on the
    receipt, its CPU; the summary counts the runs by kind."""
    held = run_times.play_record(
        "site.yml", [], 0, "TASK [x]\nok: full converge skipped: the receipt\n  holds: inputs and managed live state\n"
        "  unchanged, nothing to do\nPLAY RECAP\ngptoss-lab : ok=20 changed=0 unreachable=0 failed=0 skipped=11\n",
        2.84, 2.4, 0.5)
    assert held == {"playbook": "site.yml", "args": [], "rc": 0, "seconds": 2.8, "cpu_controller_s": 2.4,
                    "cpu_labs_s": 0.5, "tasks": 31, "changed": 0, "held": True}
    full = run_times.play_record("site.yml", ["-i", "x" * 80], 0, "gptoss-lab : ok=184 changed=2 failed=0 "
                                 "skipped=119\n", 40.0, 17.0, 22.0)
    assert full["tasks"] == 303 and full["changed"] == 2 and not full["held"] and full["args"] == ["-i", "x" * 60]
    refused = run_times.play_record("playbooks/vllm.yml", [], 2, "fatal: no PLAY RECAP", 5.0, 3.0, 1.0)
    assert refused["tasks"] == 0 and refused["rc"] == 2
    times = run_times.RunTimes()
    times.add("tests/test_a.py::test_lab", "call", 50.0, "passed", (22.4, 23.5), [held, full, refused])
    record = times.record({}, [], 0, 1)
    assert record["tests"][0]["plays"] == [held, full, refused]
    text = run_times.summary(record)
    assert "   1       2.8 s  CPU     2.4 +     0.5 s  ended on the receipt" in text
    assert "   1       5.0 s  CPU     3.0 +     1.0 s  rc != 0 (refused or failed)" in text
    assert "   1      40.0 s  CPU    17.0 +    22.0 s  ran to the end, 150+ tasks" in text


def test_the_least_available_memory_of_the_run_is_kept():
    readings = iter([9000, 4100, None, 6000])
    floor = run_times.MemoryFloor(read=lambda: next(readings, 7000))
    for _ in range(4):
        floor.sample()
    assert floor.stop() == 4100  # None (unreadable) is no reading; the last sample at stop is 7000
    times = run_times.RunTimes()
    times.memory = run_times.MemoryFloor(read=lambda: 1234)
    times.add("tests/test_a.py::test_x", "call", 1.0, "passed")
    record = times.record({}, [], 0, 1)
    assert record["mem_available_min_mib"] == 1234
    assert "least memory available 1234 MiB" in run_times.summary(record)
    assert run_times.mem_available_mib() > 0  # this machine's /proc/meminfo


def test_the_tests_running_at_the_memory_floor_are_named():
    times = run_times.RunTimes()
    times.memory = run_times.MemoryFloor(read=lambda: 1500)
    times.memory.sample()
    at = times.memory.least_at
    times.add("tests/test_a.py::test_before", "call", 1.0, "passed", worker="gw0",
              span=(at - 30.0, at - 10.0))
    times.add("tests/test_a.py::test_during", "call", 1.0, "passed", worker="gw0", span=(at - 5.0, at + 5.0))
    times.add("tests/test_b.py::test_also", "call", 1.0, "passed", worker="gw1", span=(at - 1.0, at + 60.0))
    record = times.record({}, [], 0, 2)
    assert record["mem_available_min_at_s"] == round(at - times.started_epoch, 1)
    text = run_times.summary(record)
    tail = text[text.index("when the least memory (1500 MiB) was seen:"):]
    assert "gw0   tests/test_a.py::test_during" in tail and "gw1   tests/test_b.py::test_also" in tail
    assert "test_before" not in tail
    assert "when the least memory" not in run_times.summary({**record, "mem_available_min_at_s": None})



def test_the_recap_counts_are_read_once_for_every_caller():
    assert run_times.recap_counts("host : ok=3 changed=1 failed=0\n") == {"ok": 3, "changed": 1, "failed": 0}
    assert run_times.recap_counts("no recap") == {}


def test_the_record_keeps_no_extra_vars_value():
    """A test may hand a key to a play as -e (the key rotation does): the record says "..." instead."""
    args = ["-i", "inv", "-e", "key_extra=extra-1", "--extra-vars", '{"k": "v"}', "-e=a=b", "--extra-vars=c=d",
            "--tags", "x"]
    assert run_times.args_for_record(args) == ["-i", "inv", "-e", "...", "--extra-vars", "...", "-e=...",
                                               "--extra-vars=...", "--tags", "x"]
    assert run_times.play_record("site.yml", args, 0, "", 1.0, 0.0, 0.0)["args"] == run_times.args_for_record(args)


def test_each_worker_lists_its_groups_in_the_order_they_ran_and_its_idle_end():
    times = run_times.RunTimes()
    at = times.started_epoch
    times.add("tests/test_a.py::test_one", "setup", 100.0, "passed", (10.0, 50.0), worker="gw0", span=(at, at + 100))
    times.add("tests/test_a.py::test_one", "call", 20.0, "passed", (1.0, 4.0), worker="gw0", span=(at + 100, at + 120))
    times.add("tests/test_b.py::test_two", "call", 60.0, "passed", (5.0, 0.0), worker="gw0", span=(at + 120, at + 180))
    times.add("tests/test_c.py::test_three", "call", 300.0, "passed", (30.0, 0.0), worker="gw1",
              span=(at + 1, at + 301))
    record = times.record({"tests/test_a.py::test_one": "lab-bookworm"}, [], 0, 2)
    record["wall_s"] = 360.0
    one = next(t for t in record["tests"] if t["nodeid"].endswith("test_one"))
    assert (one["worker"], one["start_s"], one["end_s"]) == ("gw0", 0.0, 120.0)
    timeline = run_times.summary(record).split("per worker")[1].split("\n\n")[0].splitlines()[1:]
    assert timeline == [
        "  gw0      0.0 min    120.0 s  CPU    65.0 s  lab-bookworm",
        "  gw0      2.0 min     60.0 s  CPU     5.0 s  1 module without a lab",
        "  gw0   idle for the last 3.0 min of the run",
        "  gw1      0.0 min    300.0 s  CPU    30.0 s  1 module without a lab",
        "  gw1   idle for the last 1.0 min of the run"]
    # Modules without a lab that ran one after another are one line.
    times.add("tests/test_d.py::test_four", "call", 30.0, "passed", (3.0, 0.0), worker="gw1", span=(at + 301, at + 331))
    record = {**times.record({}, [], 0, 2), "wall_s": 360.0}
    assert "  gw1      0.0 min    330.0 s  CPU    33.0 s  2 modules without a lab" in run_times.summary(record)
    assert "per worker" not in run_times.summary({**record, "tests": [
        {k: v for k, v in t.items() if k not in ("start_s", "end_s")} for t in record["tests"]]})


def test_vllm_starts_are_the_lines_systemd_writes_as_it_starts_a_server_unit(tmp_path):
    """`journalctl -o short-unix` text as a lab's journal holds it: a start of gptoss-vllm and of an
    instance count from the given time on; vLLM's own log lines, "Started" and other units do not."""
    text = "\n".join([
        "1000.5 gptoss-lab systemd[1]: Starting gptoss-vllm.service - gptoss: vLLM server (cpu-lab)...",
        "1010.0 gptoss-lab systemd[1]: Starting gptoss-vllm.service - gptoss: vLLM server (cpu-lab)...",
        "1010.1 gptoss-lab systemd[1]: Started gptoss-vllm.service - gptoss: vLLM server (cpu-lab).",
        "1011.0 gptoss-lab gptoss-vllm[673]: (Worker pid=673) INFO Starting to load model /models/tiny-llama...",
        "1012.0 gptoss-lab gptoss-vllm[680]: x: Starting gptoss-vllm.service (a line of the server's own)",
        "1020.0 gptoss-lab systemd[1]: Starting gptoss-vllm@1.service - gptoss: vLLM instance 1...",
        "1030.0 gptoss-lab systemd[1]: Starting gptoss-router.service - gptoss: router...",
        "-- Boot 4f1c --",
    ])
    assert run_times.count_vllm_starts(text, 1001.0) == 2
    assert run_times.count_vllm_starts(text, 0.0) == 3
    assert run_times.count_vllm_starts(text, 1030.0) == 0
    for lab in ("pytest-gw0", "pytest-gw0-copy", "pytest-gw0-trixie", "pytest-gw00", "pytest-gw1"):
        (tmp_path / lab / "rootfs" / "var" / "log" / "journal" / "0f1e").mkdir(parents=True)
    (tmp_path / "pytest-gw0-bare").mkdir()  # a lab without a journal yet
    assert [d.parts[-6] for d in run_times.lab_journal_dirs(tmp_path, "pytest-gw0")] == [
        "pytest-gw0", "pytest-gw0-copy", "pytest-gw0-trixie"]


def test_vllm_starts_show_per_test_per_group_and_in_all():
    times = run_times.RunTimes()
    times.add("tests/test_a.py::test_restart", "call", 30.0, "passed", (2.0, 45.0), vllm_starts=2)
    times.add("tests/test_a.py::test_restart", "teardown", 20.0, "passed", (1.0, 21.0), vllm_starts=1)
    times.add("tests/test_a.py::test_read", "call", 1.0, "passed", (0.5, 0.5))
    groups = {"tests/test_a.py::test_restart": "lab-bookworm", "tests/test_a.py::test_read": "lab-bookworm"}
    record = times.record(groups, [], 0, 2)
    assert record["tests"][0]["vllm_starts"] == 3 and "vllm_starts" not in record["tests"][1]
    text = run_times.summary(record)
    assert "(3.0 + 66.0)  tests/test_a.py::test_restart  (3 vLLM starts)" in text
    assert "(0.5 + 0.5)  tests/test_a.py::test_read\n" in text
    assert "lab-bookworm  (3 vLLM starts)" in text and "in the labs  (3 vLLM starts)" in text
