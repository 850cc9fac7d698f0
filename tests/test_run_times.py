"""The per-test time record (tests/run_times.py): what `invoke test-times` prints from."""

from __future__ import annotations

import json

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
                                  "seconds": 151.5, "outcome": "passed"}
    assert record["counts"] == {"passed": 2, "failed": 1}
    text = run_times.summary(record, top=2)
    assert "151.5 s  passed   tests/test_a.py::test_lab" in text and "test_unit" not in text.split("per group")[0]
    assert "151.5 s     1 tests  lab-bookworm" in text and "2.2 s     2 tests  tests/test_b.py" in text
