"""Take one serving unit out of vllm-router, wait for its in-flight requests, put it back.

Standard library only (it runs inside the vllm_change module on the host). The router's admin API:
POST /remove_worker?url=U and POST /add_worker?url=U, GET /list_workers -> {"urls": [...]}. A unit's
in-flight requests are vLLM's own gauges on its /metrics: vllm:num_requests_running + _waiting.

When the wait runs out with requests still in flight, the drain policy decides (ON_TIMEOUT):
"abort" puts the unit back into the router and raises DrainAborted (the change must not touch the
host); "proceed" returns, and the caller's restart cuts the requests counted in "in_flight".
"""

from __future__ import annotations

import json
import re
import time
import urllib.error
import urllib.parse
import urllib.request

_GAUGE = re.compile(r"^vllm:num_requests_(?:running|waiting)(?:\{[^}]*\})?\s+([0-9.eE+-]+)\s*$", re.MULTILINE)


ON_TIMEOUT = ("abort", "proceed")
# Drained means 0 in flight on this many reads in a row, a poll apart: one read of 0 can fall in the
# moment between a client's request and its next one (seen in the fleet lab with requests sent straight
# to the unit, which the router's removal does not stop).
QUIET_READS = 2


class DrainError(RuntimeError):
    """The router refused or did not answer; the message names the URL and what it said."""


class DrainAborted(DrainError):
    """The wait ran out with requests in flight and the policy is abort: the unit is back in the router."""

    def __init__(self, message: str, result: dict):
        super().__init__(message)
        self.result = result


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


def take_out(router_url: str, worker_url: str, timeout_s: float, on_timeout: str = "abort",
             poll_s: float = 0.5) -> dict:
    """Remove the unit from the router, then wait (bounded) until it has no request left: 0 in flight
    on QUIET_READS reads in a row.

    Returns {"was_listed", "drained", "waited_s", "in_flight", "on_timeout"}: in_flight is what the
    unit still ran when this stopped waiting (what a restart now cuts). When the bound passes with
    requests running: "proceed" returns (drained False, "cut" = in_flight); "abort" puts the unit back
    and raises DrainAborted (its .result says the same numbers)."""
    if on_timeout not in ON_TIMEOUT:
        raise ValueError(f"on_timeout must be one of {', '.join(ON_TIMEOUT)}, not {on_timeout!r}")
    try:
        was_listed = worker_url in listed(router_url)
    except DrainError as exc:
        # Nothing listens there yet (the first converge installs the router after the servers): no
        # traffic goes through a router that is not running, so there is nothing to drain. A router
        # that answers badly or hangs is still an error.
        if isinstance(getattr(exc.__cause__, "reason", exc.__cause__), ConnectionRefusedError):
            return {"was_listed": False, "drained": True, "waited_s": 0.0, "in_flight": 0,
                    "on_timeout": on_timeout, "router": "not running"}
        raise
    if was_listed:
        _post(f"{router_url}/remove_worker?url={urllib.parse.quote(worker_url, safe=':/')}", timeout=10)
    started = time.monotonic()
    count, zeros = worker_in_flight(worker_url), 0
    while count is not None:  # None: the unit does not answer, there is nothing left to wait for
        zeros = zeros + 1 if count == 0 else 0
        # At the bound a read of 0 still wants its second one (one more poll at most): a single 0 read
        # as the time runs out is no more a drain than one before it.
        if zeros >= QUIET_READS or (zeros == 0 and time.monotonic() - started >= timeout_s):
            break
        time.sleep(poll_s)
        count = worker_in_flight(worker_url)
    result = {"was_listed": was_listed, "drained": not count, "waited_s": round(time.monotonic() - started, 1),
              "in_flight": count or 0, "on_timeout": on_timeout}
    if count and on_timeout == "abort":
        if was_listed:
            result.update(put_back(router_url, worker_url))
        raise DrainAborted(f"{worker_url} still had {count} request(s) in flight after {result['waited_s']} s "
                           f"(drain timeout {timeout_s:g} s, on_timeout=abort); "
                           + ("it is back in the router" if was_listed else "it was not in the router"), result)
    if count:
        result["cut"] = count
    return result


def describe(result: dict) -> str:
    """One line for the play: how many requests were in flight when the change moved on."""
    if result.get("router") == "not running":
        return "no router running yet, nothing to drain"
    if result.get("drained", True):
        return f"drained: 0 requests in flight after {result.get('waited_s', 0)} s"
    return (f"moved on with {result.get('in_flight', 0)} request(s) in flight after {result.get('waited_s', 0)} s "
            f"(on_timeout={result.get('on_timeout')}: the restart cut them)")


def ensure_listed(router_url: str, worker_url: str) -> dict:
    """A unit that serves belongs in the router (the router's config names it; RTR-001 checks it),
    whether or not it was listed before this change: a host an earlier failure left out comes back with
    the next change that has it serving. A router that is not running yet (the first converge starts it
    with every worker) is left alone."""
    try:
        was_listed = worker_url in listed(router_url)
    except DrainError as exc:
        if isinstance(getattr(exc.__cause__, "reason", exc.__cause__), ConnectionRefusedError):
            return {"listed": False, "router": "not running"}
        raise
    return dict(put_back(router_url, worker_url), added=not was_listed)


def put_back(router_url: str, worker_url: str) -> dict:
    """Add the unit to the router again and confirm the router lists it."""
    if worker_url not in listed(router_url):
        _post(f"{router_url}/add_worker?url={urllib.parse.quote(worker_url, safe=':/')}", timeout=60)
    if worker_url not in listed(router_url):
        raise DrainError(f"{router_url} does not list {worker_url} after add_worker")
    return {"listed": True}
