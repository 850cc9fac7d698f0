"""MON-004's comparison: the GPU exporter's view (scraped from its /metrics) against NVML's, read through the
one reader by verify itself (stdlib only; runs on the host's system python).

The exporter runs sandboxed (DynamicUser, only the NVIDIA devices): a sandbox that hides a GPU, a lost GPU
or an exporter that cannot reach NVML at all shows here as a difference in the GPU count or in gptoss_nvml_up.
"""

from __future__ import annotations

import urllib.request
from typing import Any

from ansible_collections.gptoss.host.plugins.module_utils import prom_text


def scrape(metrics_url: str, timeout: float) -> dict[str, Any]:
    """{'up': float | None, 'count': float | None, 'reasons': [..]} from the exporter's /metrics;
    OSError / URLError when it does not answer."""
    with urllib.request.urlopen(metrics_url, timeout=timeout) as response:
        text = response.read().decode(errors="replace")
    view: dict[str, Any] = {"up": None, "count": None, "reasons": []}
    for name, labels, value in prom_text.samples(text):
        if name == "gptoss_nvml_up":
            view["up"] = value
        elif name == "gptoss_gpu_count":
            view["count"] = value
        elif name == "gptoss_nvml_error_info" and value == 1:
            view["reasons"].append(labels.get("reason", "?"))
    return view


def describe(view: dict[str, Any]) -> str:
    reasons = f" ({', '.join(view['reasons'])})" if view["reasons"] else ""
    return f"exporter: gptoss_nvml_up {view['up']:g}{reasons}, gptoss_gpu_count {view['count']:g}"


def compare(view: dict[str, Any], snapshot: dict[str, Any]) -> tuple[str, str]:
    """('pass' | 'fail' | 'no_nvml', reason) for the exporter's view against verify's NVML snapshot.
    'no_nvml': neither sees NVML, so there is no count to compare (the caller skips, as the GPU checks do)."""
    if view["up"] is None or view["count"] is None:
        return "fail", "the page has no gptoss_nvml_up / gptoss_gpu_count: not gptoss-gpu-exporter?"
    if not snapshot.get("available"):
        why = snapshot.get("reason_code") or snapshot.get("reason")
        if view["up"] == 0 and view["count"] == 0:
            said = ", ".join(view["reasons"]) or "?"
            return "no_nvml", (f"NVML is unavailable here ({why}) and the exporter says so too "
                               f"(gptoss_nvml_up 0, reason {said}): no GPU count to compare")
        return "fail", f"the exporter reads GPUs, verify's NVML does not ({why})"
    want = int(snapshot.get("gpu_count", 0))
    problems = []
    if view["up"] != 1:
        problems.append(f"the exporter's NVML is down ({', '.join(view['reasons']) or '?'}) while verify's reads "
                        f"{want} GPU(s): its sandbox (DeviceAllow=) or a lost GPU")
    if int(view["count"]) != want:
        problems.append(f"the exporter counts {view['count']:g} GPU(s), NVML {want}")
    return ("fail", "; ".join(problems)) if problems else ("pass", "")
