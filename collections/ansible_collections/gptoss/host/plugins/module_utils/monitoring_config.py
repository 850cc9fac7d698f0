"""Monitoring's one home for its rules: what Prometheus scrapes, and which inputs are refused.

Used by the filters `gptoss.host.prometheus_config` and `gptoss.host.monitoring_problems` (the role
renders the configuration and validates its inputs with them), and by verify's MON-001, which reads
the expected targets the role recorded from the same function. No Ansible import: plain functions.

Scrape jobs and their labels are a contract with the rules and dashboards (issue 25): every target
carries host=<inventory_hostname>; job="vllm" also unit=<the serving unit>; the jobs are vllm, router,
node, gpu, prometheus, alertmanager and blackbox_health.
"""

from __future__ import annotations

import base64
import hashlib
import posixpath
import re
from typing import Any

from ansible_collections.gptoss.host.plugins.module_utils.loopback import is_loopback
from ansible_collections.gptoss.host.plugins.module_utils.unit_inputs import MIN_EXPOSED_KEY_LENGTH, port_number

# Prometheus's own grammar for durations (model.ParseDuration) and sizes (units.Base2Bytes).
DURATION = re.compile(r"^((\d+)y)?((\d+)w)?((\d+)d)?((\d+)h)?((\d+)m)?((\d+)s)?((\d+)ms)?$")
SIZE = re.compile(r"^(\d+)(B|KB|MB|GB|TB|PB|EB)$")
SIZE_UNITS = {"B": 1, "KB": 2**10, "MB": 2**20, "GB": 2**30, "TB": 2**40, "PB": 2**50, "EB": 2**60}
BLACKBOX_MODULE = "http_2xx_tls"
RULE_FILES_GLOB = "*.rules.yml"


class MonitoringConfigError(ValueError):
    """An input that cannot work; the message names it."""


def size_bytes(size: str) -> int:
    """'2GB' -> 2147483648 (Prometheus counts retention sizes in powers of 1024)."""
    match = SIZE.match(str(size))
    if not match:
        raise MonitoringConfigError(f"{size!r} is not a Prometheus size such as 512MB or 2GB")
    return int(match.group(1)) * SIZE_UNITS[match.group(2)]


def _target(address: Any, port: Any, what: str, variable: str = "") -> str:
    """'address:port' of one scrape target; a bad port names the variable it came from, when known."""
    address = str(address or "").strip()
    if not address:
        raise MonitoringConfigError(f"{what}: no address")
    number, why = port_number(port)
    if number is None:
        raise MonitoringConfigError(f"{what}: {variable + ': ' if variable else ''}{why}")
    return f"[{address}]:{number}" if ":" in address else f"{address}:{number}"


def _static(job: str, targets: list[tuple[str, dict[str, str]]], **extra: Any) -> dict[str, Any] | None:
    if not targets:
        return None
    return {"job_name": job, **extra,
            "static_configs": [{"targets": [target], "labels": labels} for target, labels in targets]}


def scrape_configs(hosts: list[dict], server: dict) -> list[dict[str, Any]]:
    """Prometheus's scrape_configs for the server host and every host it scrapes.

    hosts: [{"name", "remote", "vllm_units": [{"unit", "address", "port"}], "router": {"address", "port"} | None,
             "node": {...} | None, "gpu": {...} | None}]; server: {"name", "prometheus": {"address", "port"},
             "alertmanager": {...} | None, "blackbox": {"address", "port", "target", "insecure"} | None}.
    A host other than the server that exposes an exporter on loopback cannot be scraped: refused.
    """
    jobs: dict[str, list[tuple[str, dict[str, str]]]] = {name: [] for name in ("vllm", "router", "node", "gpu")}
    for host in hosts:
        name = str(host["name"])
        remote = bool(host.get("remote"))
        units = [(u, "vllm") for u in host.get("vllm_units") or []]
        parts = units + [(host[job], job) for job in ("router", "node", "gpu") if host.get(job)]
        for part, job in parts:
            what = f"{name} {part.get('unit', job)}"
            if remote and is_loopback(str(part.get("address", ""))):
                raise MonitoringConfigError(
                    f"{what} listens on loopback ({part.get('address')}), so the Prometheus on {server['name']} "
                    "cannot scrape it: give that host a routable vllm_service_host / monitoring_exporter_address")
            labels = {"host": name, **({"unit": part["unit"]} if job == "vllm" else {})}
            jobs[job].append((_target(part.get("address"), part.get("port"), what, str(part.get("variable", ""))),
                              labels))
    own = {"host": str(server["name"])}
    configs = [
        _static("prometheus", [(_target(**server["prometheus"], what="prometheus"), own)]),
        _static("alertmanager", [(_target(**server["alertmanager"], what="alertmanager"), own)]
                if server.get("alertmanager") else []),
        *(_static(job, targets) for job, targets in jobs.items()),
    ]
    blackbox = server.get("blackbox")
    if blackbox:
        exporter = _target(blackbox["address"], blackbox["port"], "blackbox exporter")
        configs.append(_static(
            "blackbox_health", [(str(blackbox["target"]), own)], metrics_path="/probe",
            params={"module": [BLACKBOX_MODULE]},
            relabel_configs=[
                {"source_labels": ["__address__"], "target_label": "__param_target"},
                {"source_labels": ["__param_target"], "target_label": "instance"},
                {"target_label": "__address__", "replacement": exporter}]))
    return [config for config in configs if config]


def expected_targets(configs: list[dict[str, Any]]) -> list[str]:
    """'<job> <instance>' of every target, as Prometheus's /api/v1/targets labels them (MON-001)."""
    found = []
    for config in configs:
        for static in config["static_configs"]:
            for target in static["targets"]:
                found.append(f"{config['job_name']} {target}")
    return sorted(found)


def prometheus_config(hosts: list[dict], server: dict, settings: dict) -> dict[str, Any]:
    """The whole prometheus.yml as data (the role writes it as YAML, promtool checks it first)."""
    alerting = ({"alertmanagers": [{"static_configs": [{"targets": [
        _target(**server["alertmanager"], what="alertmanager")]}]}]} if server.get("alertmanager") else None)
    config: dict[str, Any] = {
        "global": {"scrape_interval": str(settings["scrape_interval"]),
                   "evaluation_interval": str(settings["evaluation_interval"])},
        "rule_files": [posixpath.join(str(settings["rules_dir"]), RULE_FILES_GLOB)],
        "scrape_configs": scrape_configs(hosts, server),
    }
    if alerting:
        config["alerting"] = alerting
    return config


def blackbox_config(insecure: bool) -> dict[str, Any]:
    """The blackbox exporter's one module: /health through the TLS proxy answers 200 over TLS."""
    return {"modules": {BLACKBOX_MODULE: {"prober": "http", "timeout": "10s", "http": {
        "method": "GET", "valid_status_codes": [200], "fail_if_not_ssl": True, "preferred_ip_protocol": "ip4",
        # A self-signed certificate (the proxy's default) cannot be verified; its expiry is still read.
        "tls_config": {"insecure_skip_verify": bool(insecure)}}}}}


def alertmanager_config(settings: dict) -> dict[str, Any]:
    """Alertmanager's configuration: one route, one receiver 'gptoss' with every configured way out."""
    receiver: dict[str, Any] = {"name": "gptoss"}
    webhooks = [{"url": str(url), "send_resolved": True} for url in settings.get("webhook_urls") or []]
    if webhooks:
        receiver["webhook_configs"] = webhooks
    if settings.get("email_to"):
        email = {"to": settings["email_to"], "from": settings["email_from"], "smarthost": settings["email_smarthost"],
                 "require_tls": bool(settings.get("email_require_tls", True)), "send_resolved": True}
        if settings.get("email_username"):
            email.update(auth_username=settings["email_username"], auth_password=settings.get("email_password", ""))
        receiver["email_configs"] = [email]
    return {"route": {"receiver": "gptoss", "group_by": ["alertname", "host"],
                      "group_wait": str(settings["group_wait"]), "group_interval": str(settings["group_interval"]),
                      "repeat_interval": str(settings["repeat_interval"])},
            "receivers": [receiver]}


def problems(inputs: dict) -> list[str]:
    """Every refused monitoring input, in words (validate asserts the list is empty)."""
    found = []
    for key in ("retention_time", "scrape_interval", "evaluation_interval", "group_wait", "group_interval",
                "repeat_interval"):
        value = str(inputs.get(key, ""))
        if not value or not DURATION.match(value):
            found.append(f"monitoring {key} {value!r} is not a Prometheus duration such as 30s, 5m or 15d")
    try:
        size_bytes(inputs.get("retention_size", ""))
    except MonitoringConfigError as err:
        found.append(f"monitoring_prometheus_retention_size: {err}")
    storage = posixpath.normpath(str(inputs.get("storage_path", "")))
    mount = posixpath.normpath(str(inputs.get("model_mount_path") or "/nonexistent-mount"))
    if not storage.startswith("/"):
        found.append(f"monitoring_prometheus_storage_path {storage!r} is not an absolute path")
    elif inputs.get("model_mount_enabled") and mount != "/" and (storage == mount or storage.startswith(mount + "/")):
        found.append(f"monitoring_prometheus_storage_path {storage} is on the model disk ({mount}): a growing "
                     "TSDB there could fill it; choose a path outside it")
    if inputs.get("email_to") and not (inputs.get("email_from") and inputs.get("email_smarthost")):
        found.append("monitoring_alertmanager_email_to needs monitoring_alertmanager_email_from and "
                     "monitoring_alertmanager_email_smarthost (host:port)")
    for url in inputs.get("webhook_urls") or []:
        if not re.match(r"^https?://[^\s/]+", str(url)):
            found.append(f"monitoring_alertmanager_webhook_urls: {url!r} is not an http(s) URL")
    if inputs.get("publish"):
        if not inputs.get("reverse_proxy_enabled"):
            found.append("monitoring_publish needs the TLS proxy (reverse_proxy_enabled: true)")
        path = str(inputs.get("publish_path", ""))
        if not re.match(r"^/[A-Za-z0-9._-]+/$", path):
            found.append(f"monitoring_publish_path {path!r} must look like /prometheus/ (one segment, slashes "
                         "on both sides)")
        password = str(inputs.get("publish_password") or "")
        if len(password) < MIN_EXPOSED_KEY_LENGTH:  # the same floor as an exposed API key
            have = "none" if not password else f"{len(password)} characters"
            found.append(f"monitoring_publish_password: {MIN_EXPOSED_KEY_LENGTH}+ characters (e.g. from ansible-vault) "
                         f"guard Prometheus beyond loopback; {have} given")
    return found


def htpasswd_line(user: str, password: str) -> str:
    """nginx's auth_basic_user_file line in its {SSHA} scheme (salted SHA-1, which nginx reads natively).

    The salt is derived from the user and password, so an unchanged password writes the same file (a
    second converge changes nothing); the file is root:www-data 0640 and the password a vault value."""
    if not user or ":" in user or "\n" in user + password:
        raise MonitoringConfigError("monitoring_publish_user/password: no ':' in the user, no newline in either")
    salt = hashlib.sha256(f"gptoss-htpasswd\0{user}\0{password}".encode()).digest()[:8]
    digest = hashlib.sha1(password.encode() + salt).digest()  # noqa: S324 - nginx's {SSHA} scheme is SHA-1
    return f"{user}:{{SSHA}}{base64.b64encode(digest + salt).decode()}\n"
