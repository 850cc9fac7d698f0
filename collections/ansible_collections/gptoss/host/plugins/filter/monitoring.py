"""Filters of the monitoring role; the rules are module_utils/monitoring_config.py's."""

from __future__ import annotations

from ansible.errors import AnsibleFilterError
from ansible_collections.gptoss.host.plugins.module_utils import monitoring_config


def prometheus_config(hosts, server, settings):
    try:
        return monitoring_config.prometheus_config(list(hosts), dict(server), dict(settings))
    except monitoring_config.MonitoringConfigError as exc:
        raise AnsibleFilterError(f"monitoring: {exc}") from None


def expected_targets(config):
    return monitoring_config.expected_targets(config["scrape_configs"])


def alertmanager_config(settings):
    return monitoring_config.alertmanager_config(dict(settings))


def blackbox_config(insecure):
    return monitoring_config.blackbox_config(bool(insecure))


def htpasswd_line(password, user):
    try:
        return monitoring_config.htpasswd_line(str(user), str(password))
    except monitoring_config.MonitoringConfigError as exc:
        raise AnsibleFilterError(str(exc)) from None


def monitoring_problems(inputs):
    return monitoring_config.problems(dict(inputs))


class FilterModule:
    def filters(self):
        return {"prometheus_config": prometheus_config, "prometheus_expected_targets": expected_targets,
                "alertmanager_config": alertmanager_config, "blackbox_config": blackbox_config,
                "monitoring_problems": monitoring_problems, "htpasswd_line": htpasswd_line}
