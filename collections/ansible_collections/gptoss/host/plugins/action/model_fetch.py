"""Action plugin for gptoss.host.model_fetch: runs the module in time slices and prints progress.

A module cannot print while it runs; a 13 GB download would show nothing for many minutes. So the
controller calls the module with a time budget, prints the progress line it returns, and calls it
again until it reports done. Resuming between slices is the module's own resume (partial files in
the staging folder), so a slice boundary costs one new HTTP request, nothing more.
"""

from __future__ import annotations

from ansible.plugins.action import ActionBase
from ansible.utils.display import Display

display = Display()
SLICE_S = 20
MAX_SLICES = 100_000  # a guard against a module that never finishes; ~23 days of slices


class ActionModule(ActionBase):
    TRANSFERS_FILES = False

    def run(self, tmp=None, task_vars=None):
        result = super().run(tmp, task_vars)
        args = dict(self._task.args)
        args.setdefault("time_budget_s", SLICE_S)
        host = (task_vars or {}).get("inventory_hostname", "")
        changed = False
        for _ in range(MAX_SLICES):
            step = self._execute_module(module_name="gptoss.host.model_fetch", module_args=args,
                                        task_vars=task_vars)
            changed = changed or bool(step.get("changed"))
            if step.get("failed") or step.get("done", True) or self._task.check_mode:
                break
            display.display(f"  [{host}] {step.get('progress', '')}")
        result.update(step)
        result["changed"] = changed
        return result
