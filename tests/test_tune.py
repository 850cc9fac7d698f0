"""controller.tune: the sweep's bookkeeping, with the play and the bench as plain callables
(the lab test, test_tune_lab.py, runs the same code against ansible-playbook and a real vLLM)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import yaml

from controller import tune


def bench_result(concurrency: int, tok_s: float, ttft_p95: float, errors: int = 0) -> dict[str, Any]:
    return {"levels": [{"concurrency": concurrency, "completed": 4, "errors": errors, "first_error": "",
                        "output_throughput": tok_s, "ttft_ms": {"p95": ttft_p95}}]}


class Recorder:
    """Rollouts and benches a test scripts: what each candidate's rollout and bench give."""

    def __init__(self, outcomes: dict[int, tuple[bool, dict | None, int]], final_ok: bool = True) -> None:
        self.outcomes, self.final_ok = outcomes, final_ok
        self.rollouts: list[tuple[dict | None, str]] = []

    def rollout(self, overrides: dict | None, holder: str) -> tuple[bool, str]:
        self.rollouts.append((overrides, holder))
        if overrides is None:
            return self.final_ok, "PLAY RECAP"
        ok = self.outcomes[overrides["max-num-seqs"]][0]
        return ok, "" if ok else "TASK [vllm_service : Validate]\nfatal: vllm_service refused max-num-batched-tokens\n"

    def bench(self, result_file: Path) -> int:
        seqs = int(result_file.stem.split("-")[1])  # candidate-N.json, N = 1-based index = seqs here
        _, result, code = self.outcomes[seqs]
        if result is not None:
            result_file.write_text(json.dumps(result))
        return code


CANDIDATES = [{"max-num-seqs": n} for n in (1, 2, 3, 4)]


def test_sweep_records_refusals_bench_failures_and_scores(tmp_path: Path) -> None:
    recorder = Recorder({1: (False, None, 0),                           # the play refused it
                         2: (True, bench_result(2, 50.0, 100.0), 0),     # fine
                         3: (True, bench_result(2, 90.0, 100.0), 3),     # bench exited 3
                         4: (True, None, 1)})                            # bench wrote nothing
    (tmp_path / "candidate-4.json").write_text(json.dumps(bench_result(2, 999.0, 1.0)))  # an earlier run's
    trials = tune.sweep(CANDIDATES, 2, tmp_path, recorder.rollout, recorder.bench)
    assert [t.status for t in trials] == ["rejected", "ok", "bench-failed", "bench-failed"]
    assert "refused max-num-batched-tokens" in trials[0].detail
    assert trials[2].detail == "bench exit 3" and trials[3].output_tok_s == 0.0
    assert [h for _, h in recorder.rollouts] == [f"invoke tune (candidate {n}/4)" for n in (1, 2, 3, 4)]
    assert len(json.loads((tmp_path / "trials.json").read_text())) == 4


def test_accepted_winner_is_written_where_the_role_reads_it_then_rolled_out(tmp_path: Path) -> None:
    recorder = Recorder({1: (True, bench_result(2, 80.0, 500.0), 0), 2: (True, bench_result(2, 95.0, 900.0), 0),
                         3: (True, bench_result(2, 60.0, 100.0), 0), 4: (False, None, 0)})
    tuned = tmp_path / "host_vars" / "h1" / "vllm_tuned.yml"
    status = tune.run(CANDIDATES, 600.0, 2, True, tmp_path / "work", tuned, recorder.rollout, recorder.bench)
    assert status == 0
    # 95 tok/s broke the 600 ms target; 80 tok/s is the best within it.
    assert yaml.safe_load(tuned.read_text()) == {"vllm_service_flags_override": {"max-num-seqs": 1}}
    assert recorder.rollouts[-1] == (None, "invoke tune (final rollout)")


def test_without_accept_or_winner_nothing_is_written_and_the_status_says_why(tmp_path: Path) -> None:
    tuned = tmp_path / "vllm_tuned.yml"
    slow = Recorder({n: (True, bench_result(2, 10.0, 5000.0), 0) for n in (1, 2, 3, 4)})
    assert tune.run(CANDIDATES, 600.0, 2, True, tmp_path / "w1", tuned, slow.rollout, slow.bench) == 1
    fine = Recorder({n: (True, bench_result(2, 10.0, 5.0), 0) for n in (1, 2, 3, 4)})
    assert tune.run(CANDIDATES, 600.0, 2, False, tmp_path / "w2", tuned, fine.rollout, fine.bench) == 0
    assert not tuned.exists()
    broken_restore = Recorder({n: (True, bench_result(2, 10.0, 5.0), 0) for n in (1, 2, 3, 4)}, final_ok=False)
    assert tune.run(CANDIDATES, 600.0, 2, False, tmp_path / "w3", tuned, broken_restore.rollout,
                    broken_restore.bench) == 2


def test_an_endpoint_that_does_not_serve_is_named_before_the_sweep() -> None:
    import socket
    from http.server import ThreadingHTTPServer
    from threading import Thread

    from conftest import JsonHandler

    class Health(JsonHandler):
        def do_GET(self):
            self._send(200 if self.path == "/health" else 404, {})

    server = ThreadingHTTPServer(("127.0.0.1", 0), Health)
    Thread(target=server.serve_forever, daemon=True).start()
    with socket.socket() as probe:  # a port nothing listens on
        probe.bind(("127.0.0.1", 0))
        free_port = probe.getsockname()[1]
    try:
        assert tune.endpoint_problem(f"http://127.0.0.1:{server.server_address[1]}") == ""
        assert tune.endpoint_problem(f"http://127.0.0.1:{free_port}").startswith(
            f"nothing answers at http://127.0.0.1:{free_port}")
    finally:
        server.shutdown()
