"""The monitoring rules' inputs (roles/monitoring/defaults/main/rules.yml): which ones are refused.

validate (roles/monitoring/tasks/validate_rules.yml) asserts the list is empty before anything changes;
promtool checks the rendered file again before it replaces the live one. Standard library only.
"""

from __future__ import annotations

import re
from typing import Any

from ansible_collections.gptoss.host.plugins.module_utils.monitoring_config import DURATION


def _number(value: Any) -> float | None:
    try:
        return float(value)
    except (TypeError, ValueError):
        return None


def slo_problem(name: str, value: Any, edges: list[Any]) -> str | None:
    """An SLO must sit on a bucket edge of vLLM's histogram: p95 > an edge is exact, p95 > a value inside
    a bucket is histogram_quantile's linear guess (TTFT's edges jump 750 -> 1000 -> 2500 ms)."""
    number = _number(value)
    numbers = sorted(n for n in map(_number, edges) if n is not None)
    if number is None or number <= 0:
        return f"{name} {value!r} is not a positive number of milliseconds"
    if number not in numbers:
        below = max((n for n in numbers if n < number), default=None)
        above = min((n for n in numbers if n > number), default=None)
        return (f"{name} {value:g} ms is not an edge of vLLM's histogram buckets (nearest: {below:g} and {above:g} "
                "ms); an alert on it would be a guess" if below is not None and above is not None else
                f"{name} {value:g} ms is outside vLLM's histogram buckets")
    return None


def problems(inputs: dict) -> list[str]:
    """Every refused input, in words. inputs: durations, ratios (0..1], counts (>= 0), the two SLOs with
    their bucket edges, the restart unit regex and the expected GPUs per host."""
    found = []
    for name, value in sorted(inputs.get("durations", {}).items()):
        if not DURATION.match(str(value)) or not str(value):
            found.append(f"{name} {value!r} is not a Prometheus duration such as 30s, 5m or 1h")
    for name, value in sorted(inputs.get("ratios", {}).items()):
        number = _number(value)
        if number is None or not 0 < number <= 1:
            found.append(f"{name} {value!r} is not a share between 0 and 1 (0.9 = 90%)")
    for name, value in sorted(inputs.get("counts", {}).items()):
        number = _number(value)
        if number is None or number < 0:
            found.append(f"{name} {value!r} is not a number >= 0")
    for name, (value, edges) in sorted(inputs.get("slos", {}).items()):
        problem = slo_problem(name, value, edges)
        if problem:
            found.append(problem)
    try:
        re.compile(str(inputs.get("restart_units", "")))
    except re.error as err:
        found.append(f"monitoring_rules_restart_units is not a regular expression: {err}")
    for host, count in sorted((inputs.get("expected_gpus") or {}).items()):
        number = _number(count)
        if number is None or number < 0 or number != int(number):
            found.append(f"monitoring_rules_expected_gpus: {host}: {count!r} is not a whole number >= 0")
    return found
