"""Monitoring's live state, as Prometheus and Alertmanager report it (verify's MON-001..003, `invoke alerts`).

Standard library only. Each function asks one API and compares with what the role recorded
(verify.d/monitoring.json); checks.py turns the answers into report rows. Also a command:
`python3 -m service.host.monitoring_check alerts --prometheus URL [--alertmanager URL]` prints the
alerts firing as JSON (what `invoke alerts` shows per host).
"""

from __future__ import annotations

import argparse
import datetime
import hashlib
import json
import os
import re
import sys
import time
import urllib.error
import urllib.parse
import urllib.request
from typing import Any

from ansible_collections.gptoss.host.plugins.module_utils import prom_text, verify_contract

# A target not scraped yet (Prometheus just (re)started) reads "unknown": wait up to this long for a verdict.
FIRST_SCRAPE_WAIT_S = 30.0
# After a (re)load, Prometheus's discovery manager hands the new targets to its scrape manager at most every
# 5 s, so for a few seconds the API lists none of them (the demo's verify, 4 s after the role's reload, read
# every target as not configured). A target missing that soon after a reload is waited for, not reported.
RELOAD_SETTLE_S = 15.0


def get_json(url: str, timeout: float) -> Any:
    with urllib.request.urlopen(url, timeout=timeout) as response:
        return json.load(response)


def prometheus_data(base: str, path: str, timeout: float) -> Any:
    answer = get_json(base.rstrip("/") + path, timeout)
    if answer.get("status") != "success":
        raise ValueError(f"{path}: {answer.get('error') or answer}")
    return answer["data"]


def _scraped_at(target: dict[str, Any]) -> float:
    """A target's lastScrape as epoch seconds (RFC 3339 with nanoseconds; 0 when never scraped)."""
    stamp = str(target.get("lastScrape", ""))
    match = re.match(r"(\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d)(\.\d+)?(Z|[+-]\d\d:\d\d)$", stamp)
    if not match or stamp.startswith("0001-"):
        return 0.0
    zone = "+00:00" if match.group(3) == "Z" else match.group(3)
    moment = datetime.datetime.fromisoformat(match.group(1) + zone).timestamp()
    return moment + float(match.group(2) or 0.0)


def _interval_s(target: dict[str, Any]) -> float:
    value = re.fullmatch(r"(\d+)(ms|s|m)", str(target.get("scrapeInterval", "")))
    return int(value.group(1)) * {"ms": 0.001, "s": 1.0, "m": 60.0}[value.group(2)] if value else 60.0


def targets(base: str, expected: list[str], timeout: float, wait_s: float = FIRST_SCRAPE_WAIT_S,
            settle_s: float = RELOAD_SETTLE_S) -> dict[str, Any]:
    """{"up": [...], "down": {target: error}, "missing": [...], "unexpected": [...]}, keyed '<job> <instance>'.

    A verdict is the target's last scrape, up to an interval old. A target not scraped yet ("unknown":
    Prometheus just started) is waited for, and so is one that is down: its last scrape may predate a
    restart that has since finished (verify right after vLLM came back read "down" in the suite), so it
    is asked again once a scrape newer than this call exists, at most one interval (+ 5 s) later. A target
    missing from the API is waited for only while the configuration is under `settle_s` old (a reload just
    now: its targets are not handed over yet); later, missing means not configured."""
    asked_at = time.time()
    deadline = time.monotonic() + wait_s
    while True:
        active = prometheus_data(base, "/api/v1/targets?state=active", timeout)["activeTargets"]
        seen = {f"{t['labels'].get('job')} {t['labels'].get('instance')}": t for t in active}
        unknown = [key for key in expected if key in seen and seen[key].get("health") == "unknown"]
        stale_down = [key for key in expected if key in seen and seen[key].get("health") == "down"
                      and _scraped_at(seen[key]) < asked_at
                      and time.time() < asked_at + _interval_s(seen[key]) + 5.0]
        settling = any(key not in seen for key in expected) and time.time() < last_reload(base, timeout) + settle_s
        if not (unknown or stale_down or settling) or time.monotonic() >= deadline:
            break
        time.sleep(1)
    return {
        "up": sorted(key for key in expected if key in seen and seen[key].get("health") == "up"),
        "down": {key: seen[key].get("lastError") or seen[key].get("health", "?")
                 for key in expected if key in seen and seen[key].get("health") != "up"},
        "missing": sorted(key for key in expected if key not in seen),
        "unexpected": sorted(key for key in seen if key not in expected),
    }


def metric_value(base: str, name: str, timeout: float) -> float | None:
    """One unlabelled sample from a service's own /metrics (None when it has no such series)."""
    with urllib.request.urlopen(base.rstrip("/") + "/metrics", timeout=timeout) as response:
        text = response.read().decode("utf-8", "replace")
    values = [value for sample, _, value in prom_text.samples(text) if sample == name]
    return values[0] if values else None


def last_reload(base: str, timeout: float) -> float:
    """When this Prometheus last loaded its configuration, from its own /metrics: live, unlike a query of
    its TSDB, whose newest sample is up to a scrape interval old (a reload just now would read as pending)
    and which may hold other series of that name (a restored or copied data folder: another instance's)."""
    return metric_value(base, "prometheus_config_last_reload_success_timestamp_seconds", timeout) or 0.0


def rules(base: str, rule_files: list[str], inputs: list[str], timeout: float) -> dict[str, Any]:
    """Rule files loaded, rules whose evaluation fails, and files changed since the last good reload."""
    groups = prometheus_data(base, "/api/v1/rules", timeout)["groups"]
    loaded = {g.get("file") for g in groups}
    failing = {f"{g.get('name')}/{r.get('name')}": r.get("lastError") or r.get("health")
               for g in groups for r in g.get("rules", []) if r.get("health") == "err"}
    flags = prometheus_data(base, "/api/v1/status/flags", timeout)
    reloaded_at = last_reload(base, timeout)
    watched = [flags.get("config.file", "")] + list(rule_files)
    pending = sorted(path for path in watched if path and os.path.exists(path) and os.stat(path).st_mtime > reloaded_at)
    return {"groups": len(groups), "rules": sum(len(g.get("rules", [])) for g in groups),
            "not_loaded": sorted(f for f in rule_files if f not in loaded), "failing": failing,
            "reload_pending": pending, "missing_inputs": sorted(p for p in inputs if not os.path.exists(p))}


def alertmanager_config_hash(data: bytes) -> float:
    """The value Alertmanager exports as alertmanager_config_hash for a configuration file's bytes: the
    first 48 bits of its MD5, little-endian (48 fit a float64's mantissa). Checked against Alertmanager
    0.25's own metric (tests/test_monitoring_check.py)."""
    return float(int.from_bytes(hashlib.md5(data).digest()[:6], "little"))  # noqa: S324 - Alertmanager's hash


def alertmanager(base: str, receivers: list[str], config_file: str, timeout: float) -> dict[str, Any]:
    """Alertmanager runs the configuration file the role wrote (its exported hash equals the file's) and
    that file holds every receiver the role configured. Why not look for the receivers in the status API:
    Alertmanager 0.28 (Debian 13) shows a webhook's URL there as <secret>."""
    status = get_json(base.rstrip("/") + "/api/v2/status", timeout)
    try:
        with open(config_file, "rb") as handle:
            data = handle.read()
    except OSError as err:
        data, file_error = b"", f"{config_file}: {err.strerror}"
    else:
        file_error = ""
    running = metric_value(base, "alertmanager_config_hash", timeout)
    text = data.decode("utf-8", "replace")
    wanted = [r.split(" ", 1)[1] if r.startswith("email ") else r for r in receivers]
    return {"version": (status.get("versionInfo") or {}).get("version", "?"),
            "cluster": (status.get("cluster") or {}).get("status", "?"),
            "file_error": file_error,
            "running_is_file": bool(data) and running == alertmanager_config_hash(data),
            "missing": [r for r, needle in zip(receivers, wanted, strict=True) if needle not in text]}


def firing(prometheus: str, alertmanager_url: str, timeout: float) -> dict[str, Any]:
    """The alerts firing (Prometheus) and what Alertmanager holds for delivery."""
    alerts = prometheus_data(prometheus, "/api/v1/alerts", timeout)["alerts"]
    out: dict[str, Any] = {"prometheus": prometheus, "alerts": [
        {"name": a["labels"].get("alertname", "?"), "state": a.get("state"), "since": a.get("activeAt", ""),
         "labels": {k: v for k, v in a["labels"].items() if k != "alertname"},
         "summary": (a.get("annotations") or {}).get("summary") or (a.get("annotations") or {}).get("description", "")}
        for a in alerts]}
    if alertmanager_url:
        try:
            held = get_json(alertmanager_url.rstrip("/") + "/api/v2/alerts?active=true&silenced=false", timeout)
            out["alertmanager"] = sorted({a["labels"].get("alertname", "?") for a in held})
        except (OSError, urllib.error.URLError, ValueError) as err:
            out["alertmanager_error"] = str(err)
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="Alerts firing on this host's Prometheus, as JSON")
    sub = parser.add_subparsers(dest="command", required=True)
    alerts = sub.add_parser("alerts")
    alerts.add_argument("--record", default="/etc/gptoss/verify.d/monitoring.json",
                        help="the role's record: where Prometheus and Alertmanager listen (default %(default)s)")
    alerts.add_argument("--timeout", type=float, default=10.0)
    args = parser.parse_args(argv)
    try:
        with open(args.record, encoding="utf-8") as handle:
            data = verify_contract.check_record("monitoring", json.load(handle))
        record = verify_contract.RoleRecord("monitoring", data)
    except (OSError, ValueError) as err:
        print(json.dumps({"error": f"{args.record}: {err} (is the monitoring role applied?)"}))
        return 2
    if not record.get("prometheus_url"):
        print(json.dumps({"scraped_by": record.get("server", "?"), "alerts": []}))
        return 0
    try:
        print(json.dumps(firing(record["prometheus_url"], record.get("alertmanager_url", ""), args.timeout)))
    except (OSError, urllib.error.URLError, ValueError, KeyError) as err:
        print(json.dumps({"error": f"Prometheus at {record['prometheus_url']} did not answer: {err}"}))
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
