"""`invoke tune`: the flag grid, the sweep, and how it picks a winner (stdlib and service.host only).

A candidate is a dict of vLLM flag overrides. Each one is rolled out with the safe rollout and
benchmarked; `pick_best` takes the highest output throughput among the candidates whose p95 TTFT
stays within the user's target, at the concurrency the target is about.
"""

from __future__ import annotations

import itertools
import json
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from service.host import rollout


@dataclass
class Trial:
    overrides: dict[str, Any]
    status: str  # "ok", "rejected" (validation or rollout failed), "bench-failed"
    output_tok_s: float = 0.0
    ttft_p95_ms: float = float("inf")
    detail: str = ""
    bench: dict[str, Any] = field(default_factory=dict)


def parse_int_list(text: str) -> list[int]:
    return [int(part) for part in text.split(",") if part.strip()]


def grid(max_num_seqs: list[int], max_num_batched_tokens: list[int], chunked_prefill: list[bool],
         parallel_layouts: list[dict[str, Any]] | None = None) -> list[dict[str, Any]]:
    """Every combination, as flag overrides (flag names without dashes, as in the profiles)."""
    layouts = parallel_layouts or [{}]
    return [
        {"max-num-seqs": seqs, "max-num-batched-tokens": tokens, "enable-chunked-prefill": chunked, **layout}
        for seqs, tokens, chunked, layout in itertools.product(max_num_seqs, max_num_batched_tokens,
                                                               chunked_prefill, layouts)
    ]


# TP=2 versus two replicas: only meaningful where there are two GPUs.
TWO_GPU_LAYOUTS = [{"tensor-parallel-size": 2, "data-parallel-size": None},
                   {"tensor-parallel-size": 1, "data-parallel-size": 2}]


def level_at(bench: dict[str, Any], concurrency: int) -> dict[str, Any] | None:
    for level in bench.get("levels", []):
        if level.get("label") in (f"c={concurrency}", str(concurrency)) or level.get("concurrency") == concurrency:
            return level
    return None


def score(overrides: dict[str, Any], bench: dict[str, Any], concurrency: int) -> Trial:
    level = level_at(bench, concurrency)
    if level is None or not level.get("completed") or level.get("errors"):
        reason = "no such level" if level is None else f"{level.get('errors')} errors: {level.get('first_error')}"
        return Trial(overrides, "bench-failed", detail=reason, bench=bench)
    return Trial(overrides, "ok", output_tok_s=float(level["output_throughput"]),
                 ttft_p95_ms=float(level["ttft_ms"]["p95"]), bench=bench)


def pick_best(trials: list[Trial], ttft_p95_target_ms: float) -> Trial | None:
    within = [t for t in trials if t.status == "ok" and t.ttft_p95_ms <= ttft_p95_target_ms]
    return max(within, key=lambda t: t.output_tok_s, default=None)


def format_trials(trials: list[Trial], target_ms: float, best: Trial | None) -> str:
    lines = [f"{'candidate':<70} {'status':<12} {'out tok/s':>10} {'TTFT p95 ms':>12}  within {target_ms:g} ms"]
    for trial in trials:
        name = " ".join(f"{k}={v}" for k, v in trial.overrides.items())
        mark = "  <- best" if trial is best else ""
        within = "yes" if trial.status == "ok" and trial.ttft_p95_ms <= target_ms else "no"
        ttft = f"{trial.ttft_p95_ms:.1f}" if trial.status == "ok" else "-"
        lines.append(f"{name:<70} {trial.status:<12} {trial.output_tok_s:>10.1f} {ttft:>12}  {within}{mark}"
                     + (f"  ({trial.detail})" if trial.detail else ""))
    return "\n".join(lines)


# ---------------------------------------------------------------- the sweep (invoke tune calls it)

# A rollout of the play with some overrides (None: the inventory's own configuration), under a lock
# holder name; returns whether it passed and its output. The bench writes its JSON result to a path
# and returns its exit code. tasks.py binds both to ansible-playbook and controller.bench.
Rollout = Callable[[dict[str, Any] | None, str], tuple[bool, str]]
Bench = Callable[[Path], int]


def endpoint_problem(base_url: str) -> str:
    """'' when `base_url` answers /health, else why not (the rollout gate's own probe). Checked before
    the sweep: with a replica profile the single unit's port serves nothing, and every candidate
    would be scored as failed."""
    base_url = base_url.rstrip("/")
    state = rollout.health_status(base_url)
    if state is None:
        return ""
    if state.startswith("HTTP "):
        return f"{base_url}/health answered {state}"
    return f"nothing answers at {base_url} ({state})"


def rejection_reason(play_output: str) -> str:
    """The play's last line about the vllm_service role: where the validation or the gate said why."""
    return next((line.strip() for line in reversed(play_output.splitlines()) if "vllm_service" in line),
                "rollout failed")[:160]


def sweep(candidates: list[dict[str, Any]], concurrency: int, work_dir: Path,
          rollout: Rollout, bench: Bench) -> list[Trial]:
    """Roll out each candidate behind the health gate and benchmark it; a refused one is recorded, not fatal."""
    work_dir.mkdir(parents=True, exist_ok=True)
    trials: list[Trial] = []
    for number, overrides in enumerate(candidates, start=1):
        print(f"\n== tune {number}/{len(candidates)}: {overrides}", flush=True)
        passed, output = rollout(overrides, f"invoke tune (candidate {number}/{len(candidates)})")
        if not passed:
            trials.append(Trial(overrides, "rejected", detail=rejection_reason(output)))
            continue
        result_file = work_dir / f"candidate-{number}.json"
        result_file.unlink(missing_ok=True)  # never score an earlier run's result
        exit_code = bench(result_file)
        result = json.loads(result_file.read_text()) if result_file.exists() else {}
        trial = score(overrides, result, concurrency)
        if exit_code != 0 and trial.status == "ok":
            trial.status, trial.detail = "bench-failed", f"bench exit {exit_code}"
        trials.append(trial)
    (work_dir / "trials.json").write_text(json.dumps([t.__dict__ for t in trials], indent=2, default=str))
    return trials


def tuned_vars_yaml(best: Trial, ttft_p95_ms: float, concurrency: int) -> str:
    """host_vars content that keeps the winner (read by the vllm_service role as its override)."""
    return ("---\n# Written by `invoke tune`: the best candidate within p95 TTFT <= "
            f"{ttft_p95_ms:g} ms at concurrency {concurrency}.\n"
            "vllm_service_flags_override:\n"
            + "".join(f"  {k}: {json.dumps(v)}\n" for k, v in best.overrides.items()))


def run(candidates: list[dict[str, Any]], ttft_p95_ms: float, concurrency: int, accept: bool,
        work_dir: Path, tuned_file: Path, rollout: Rollout, bench: Bench) -> int:
    """The whole of `invoke tune`: sweep, pick, keep the winner when accepted, then roll out what the
    inventory now says (the winner, or the previous configuration). 0: a winner; 1: none met the
    target; 2: the final rollout failed."""
    trials = sweep(candidates, concurrency, work_dir, rollout, bench)
    best = pick_best(trials, ttft_p95_ms)
    print("\n" + format_trials(trials, ttft_p95_ms, best))
    if best is not None and accept:
        tuned_file.parent.mkdir(parents=True, exist_ok=True)
        tuned_file.write_text(tuned_vars_yaml(best, ttft_p95_ms, concurrency))
        print(f"tune: winner kept in {tuned_file}; rolling it out")
    elif best is None:
        print(f"tune: no candidate met p95 TTFT <= {ttft_p95_ms:g} ms; restoring the previous configuration")
    else:
        print("tune: winner not accepted (pass --accept to keep it); restoring the previous configuration")
    passed, _ = rollout(None, "invoke tune (final rollout)")
    if not passed:
        print("tune: restoring the configuration failed; see the play output above")
        return 2
    return 0 if best is not None else 1
