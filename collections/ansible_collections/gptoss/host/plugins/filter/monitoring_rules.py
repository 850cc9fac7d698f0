"""Filters of the monitoring rules: gptoss.host.mount_point_of (module_utils/mountinfo.py: the mount
point a path lives on, for the TSDB disk alert) and gptoss.host.monitoring_rule_problems
(module_utils/monitoring_rules.py: the refused thresholds)."""

from __future__ import annotations

from ansible_collections.gptoss.host.plugins.module_utils import monitoring_rules
from ansible_collections.gptoss.host.plugins.module_utils.mountinfo import mount_point_of


class FilterModule:
    def filters(self):
        return {"mount_point_of": mount_point_of,
                "monitoring_rule_problems": lambda inputs: monitoring_rules.problems(dict(inputs))}
