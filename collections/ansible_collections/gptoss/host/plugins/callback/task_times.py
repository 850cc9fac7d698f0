"""Where a play's time goes: wall seconds per task, summed over hosts and loop items, as JSON.

Enabled by `invoke bench-converge` (ANSIBLE_CALLBACKS_ENABLED=gptoss.host.task_times) with the output
file in GPTOSS_TASK_TIMES; silent otherwise. It measures from a task's start to the last host's
result, so a task that waits on a slow host counts as slow, which is what a converge feels.
"""

from __future__ import annotations

DOCUMENTATION = r"""
name: task_times
type: aggregate
short_description: Wall seconds per task, written as JSON to $GPTOSS_TASK_TIMES
description:
  - Records, for every task of the run, the seconds from its start until its last result.
  - Writes a JSON list sorted by seconds (slowest first) when the playbook ends.
requirements:
  - GPTOSS_TASK_TIMES set to the output path (nothing is written without it).
"""

import json
import os
import time

from ansible.plugins.callback import CallbackBase


class CallbackModule(CallbackBase):
    CALLBACK_VERSION = 2.0
    CALLBACK_TYPE = "aggregate"
    CALLBACK_NAME = "gptoss.host.task_times"
    CALLBACK_NEEDS_ENABLED = True

    def __init__(self) -> None:
        super().__init__()
        self._current: tuple[str, float] | None = None
        self._seconds: dict[str, float] = {}
        self._order: list[str] = []

    def _close_current(self) -> None:
        if self._current is not None:
            name, started = self._current
            self._seconds[name] = self._seconds.get(name, 0.0) + time.monotonic() - started
            self._current = None

    def _start(self, task) -> None:
        self._close_current()
        name = task.get_name()
        if name not in self._seconds:
            self._order.append(name)
            self._seconds[name] = 0.0
        self._current = (name, time.monotonic())

    def v2_playbook_on_task_start(self, task, is_conditional):
        self._start(task)

    def v2_playbook_on_handler_task_start(self, task):
        self._start(task)

    def v2_playbook_on_stats(self, stats):
        self._close_current()
        path = os.environ.get("GPTOSS_TASK_TIMES")
        if not path:
            return
        rows = sorted(({"task": name, "seconds": round(self._seconds[name], 3)} for name in self._order),
                      key=lambda row: -row["seconds"])
        with open(path, "w", encoding="utf-8") as out:
            json.dump(rows, out, indent=1)
