"""The flag grid `invoke tune` sweeps, and how it picks a winner (pure logic, stdlib only).

A candidate is a dict of vLLM flag overrides. Each one is rolled out with the safe rollout and
benchmarked; `pick_best` takes the highest output throughput among the candidates whose p95 TTFT
stays within the user's target, at the concurrency the target is about.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field
from typing import Any


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
