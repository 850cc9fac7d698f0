"""The router's one home for its rules: which workers it routes to, and its command line.

Used by the `gptoss.host.router_config` module (writes /etc/gptoss/router.json), by the host-side
launcher `service/venv/router_launch.py` (reads it) and by the router check (compares what the running
router lists with what the inventory says). No Ansible import here: plain functions, unit-tested.
"""

from __future__ import annotations

import ipaddress
import json
import re
from typing import Any

from ansible_collections.gptoss.host.plugins.module_utils.loopback import is_loopback
from ansible_collections.gptoss.host.plugins.module_utils.unit_inputs import port_number

# Routing policies we let users pick. The installed vllm-router's own parser is the final judge
# (the launcher's --check runs it before the config is written); this list only gives the early,
# clear error for a typo in the inventory.
KNOWN_POLICIES = ("cache_aware", "round_robin", "consistent_hash", "power_of_two", "random",
                  "kv_aware", "sticky_least_loaded")

_HOSTNAME = re.compile(r"^[A-Za-z0-9]([A-Za-z0-9.-]{0,251}[A-Za-z0-9])?$")


class RouterConfigError(ValueError):
    """A router setting or worker list that cannot work; the message names the culprit."""


def _check_port(value: Any, what: str) -> int:
    port, why = port_number(value)
    if port is None:
        raise RouterConfigError(f"{what}: {why}")
    return port


def _check_address(value: Any, what: str) -> str:
    address = str(value or "").strip()
    if not address:
        raise RouterConfigError(f"{what}: no address")
    try:
        ip = ipaddress.ip_address(address)
        return f"[{ip}]" if ip.version == 6 else str(ip)
    except ValueError:
        if not _HOSTNAME.match(address):
            raise RouterConfigError(f"{what}: {address!r} is neither an IP address nor a host name") from None
        return address


def worker_urls(hosts: list[dict]) -> list[str]:
    """Every serving unit of every host, as the router's worker URLs, in inventory order.

    Each host: {"name", "address", "port", "instances": [{"name", "port"}, ...], "remote"}: remote is
    true when the router runs on another host. A host with
    instances serves one unit per instance (per-GPU replicas, each on its own port); a host without
    serves the one unit on "port". Two units on one address:port, or no worker at all, is an error:
    the router would silently send twice the traffic to one server, or to none.
    """
    urls: list[str] = []
    seen: dict[str, str] = {}
    for host in hosts:
        name = str(host.get("name") or "?")
        address = _check_address(host.get("address"), f"host {name}")
        # A server bound to loopback answers only on its own host: a router elsewhere never reaches it.
        if host.get("remote") and is_loopback(address):
            raise RouterConfigError(f"host {name} serves on {address}, a loopback address, so the router on "
                                    "another host cannot reach it: set its vllm_service_host to a routable "
                                    "address (with an API key)")
        instances = host.get("instances") or []
        units = ([(f"{name}/{inst.get('name', index)}", inst.get("port")) for index, inst in enumerate(instances)]
                 if instances else [(name, host.get("port"))])
        for unit, port in units:
            url = f"http://{address}:{_check_port(port, unit)}"
            if url in seen:
                raise RouterConfigError(f"{unit} and {seen[url]} both serve {url}")
            seen[url] = unit
            urls.append(url)
    if not urls:
        raise RouterConfigError("no workers: the router's group has no serving hosts")
    return urls


def router_argv(settings: dict, urls: list[str]) -> list[str]:
    """The vllm-router arguments (without the program name and without any key).

    The API key never appears here: the launcher reads it from the root-only environment file
    that systemd passes, so it is not in argv (ps) nor in the world-readable config.
    """
    policy = str(settings.get("policy", "cache_aware"))
    if policy not in KNOWN_POLICIES:
        raise RouterConfigError(f"policy {policy!r} is not one of {', '.join(KNOWN_POLICIES)}")
    host = _check_address(settings.get("host", "127.0.0.1"), "router listen address").strip("[]")
    argv = ["--host", host, "--port", str(_check_port(settings.get("port", 8100), "router")),
            "--policy", policy, "--worker-urls", *urls]
    # Always explicit: the router opens its metrics port (29000) even when not asked to, and two
    # routers on one address (labs sharing the network) would collide on it.
    argv += ["--prometheus-host", _check_address(settings.get("prometheus_host", host), "router metrics address")
             .strip("[]"), "--prometheus-port", str(_check_port(settings.get("prometheus_port", 29000),
                                                                  "router metrics"))]
    # Health: how fast a dead worker leaves the rotation (interval x failure threshold, plus the
    # circuit breaker that trips on failed requests in between) and how soon it comes back.
    for key in ("health_check_interval_secs", "health_check_timeout_secs", "health_failure_threshold",
                "health_success_threshold", "worker_startup_timeout_secs", "retry_max_retries",
                "cb_failure_threshold", "cb_timeout_duration_secs", "request_timeout_secs"):
        value = settings.get(key)
        if value is None or value == "":
            continue
        if isinstance(value, bool) or not str(value).isdigit() or int(value) < 1:
            raise RouterConfigError(f"{key}: {value!r} is not a positive whole number")
        argv += ["--" + key.replace("_", "-"), str(int(value))]
    argv += ["--health-check-endpoint", "/health"]
    return argv


def render_config(settings: dict, hosts: list[dict]) -> str:
    """The JSON the launcher reads: stable key order so an unchanged inventory writes the same bytes."""
    urls = worker_urls(hosts)
    return json.dumps({"workers": urls, "argv": router_argv(settings, urls)}, indent=2, sort_keys=True) + "\n"


def compare_workers(expected: list[str], listed: list[str]) -> dict[str, list[str]]:
    """What the running router lists against what the inventory says: missing and unexpected URLs."""
    want, have = set(expected), set(listed)
    return {"missing": sorted(want - have), "unexpected": sorted(have - want)}
