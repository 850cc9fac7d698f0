"""Filters gptoss.host.is_loopback and gptoss.host.exposed_key_problem: the rules of module_utils
(loopback.is_loopback; unit_inputs.exposed_key_problem, the API key's length off loopback) for the
roles' YAML, so that no role writes them again."""

from __future__ import annotations

from ansible_collections.gptoss.host.plugins.module_utils.loopback import is_loopback
from ansible_collections.gptoss.host.plugins.module_utils.unit_inputs import exposed_key_problem


class FilterModule:
    def filters(self):
        return {"is_loopback": is_loopback, "exposed_key_problem": lambda key: exposed_key_problem(str(key or ""))}
