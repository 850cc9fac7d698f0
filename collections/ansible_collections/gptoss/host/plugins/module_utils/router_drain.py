"""Take one serving unit out of vllm-router, wait for its in-flight requests, put it back.

Standard library only (it runs inside the vllm_change module on the host). The router's admin API:
POST /remove_worker?url=U and POST /add_worker?url=U, GET /list_workers -> {"urls": [...]}. A unit's
in-flight requests are vLLM's own gauges on its /metrics: vllm:num_requests_running + _waiting.
"""

from __future__ import annotations

import json
import re
import time
import urllib.error
import urllib.parse
import urllib.request

_GAUGE = re.compile(r"^vllm:num_requests_(?:running|waiting)(?:\{[^}]*\})?\s+([0-9.eE+-]+)\s*$", re.MULTILINE)


class DrainError(RuntimeError):
    """The router refused or did not answer; the message names the URL and what it said."""


def _post(url: str, timeout: float) -> str:
    request = urllib.request.Request(url, data=b"", method="POST")
    try:
        with urllib.request.urlopen(request, timeout=timeout) as response:
            return response.read().decode(errors="replace")
    except urllib.error.HTTPError as exc:
        raise DrainError(f"{url}: HTTP {exc.code} {exc.read().decode(errors='replace')[:200]}") from exc
    except (OSError, urllib.error.URLError) as exc:
        raise DrainError(f"{url}: {exc}") from exc


def listed(router_url: str, timeout: float = 5.0) -> list[str]:
    try:
        with urllib.request.urlopen(f"{router_url}/list_workers", timeout=timeout) as response:
            return list(json.load(response).get("urls", []))
    except (OSError, urllib.error.URLError, ValueError) as exc:
        raise DrainError(f"{router_url}/list_workers: {exc}") from exc


def in_flight(metrics_text: str) -> int:
    """Running + waiting requests from a vLLM /metrics page (0 when the gauges are absent)."""
    return int(sum(float(value) for value in _GAUGE.findall(metrics_text)))


def worker_in_flight(worker_url: str, timeout: float = 5.0) -> int | None:
    """In-flight requests of the unit, or None when it does not answer (nothing left to wait for)."""
    try:
        with urllib.request.urlopen(f"{worker_url}/metrics", timeout=timeout) as response:
            return in_flight(response.read().decode(errors="replace"))
    except (OSError, urllib.error.URLError):
        return None


def take_out(router_url: str, worker_url: str, timeout_s: float, poll_s: float = 0.5) -> dict:
    """Remove the unit from the router, then wait (bounded) until it has no request left.

    Returns {"was_listed", "drained", "waited_s", "in_flight"}; drained is False when the bound
    passed with requests still running (the caller restarts anyway: the bound is the promise)."""
    try:
        was_listed = worker_url in listed(router_url)
    except DrainError as exc:
        # Nothing listens there yet (the first converge installs the router after the servers): no
        # traffic goes through a router that is not running, so there is nothing to drain. A router
        # that answers badly or hangs is still an error.
        if isinstance(getattr(exc.__cause__, "reason", exc.__cause__), ConnectionRefusedError):
            return {"was_listed": False, "drained": True, "waited_s": 0.0, "in_flight": 0,
                    "router": "not running"}
        raise
    if was_listed:
        _post(f"{router_url}/remove_worker?url={urllib.parse.quote(worker_url, safe=':/')}", timeout=10)
    started = time.monotonic()
    count = worker_in_flight(worker_url)
    while count and time.monotonic() - started < timeout_s:
        time.sleep(poll_s)
        count = worker_in_flight(worker_url)
    return {"was_listed": was_listed, "drained": not count, "waited_s": round(time.monotonic() - started, 1),
            "in_flight": count or 0}


def put_back(router_url: str, worker_url: str) -> dict:
    """Add the unit to the router again and confirm the router lists it."""
    if worker_url not in listed(router_url):
        _post(f"{router_url}/add_worker?url={urllib.parse.quote(worker_url, safe=':/')}", timeout=60)
    if worker_url not in listed(router_url):
        raise DrainError(f"{router_url} does not list {worker_url} after add_worker")
    return {"listed": True}
