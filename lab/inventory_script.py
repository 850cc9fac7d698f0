"""The body of the lab's dynamic inventory scripts (inventory/lab.py, inventory/fleet.py)."""

from __future__ import annotations

import json
import os
import sys
from collections.abc import Callable
from typing import Any


def main(inventory: Callable[[str], dict[str, Any]], missing_hint: str) -> None:
    """Ansible's script protocol: `--list` prints the groups and hosts, `--host` an empty dict
    (every host's variables are in `_meta`). An empty inventory says how to bring one up."""
    if "--host" in sys.argv:
        print("{}")
        return
    data = inventory(os.environ.get("GPTOSS_LAB", "default"))
    if not data["lab"]["hosts"]:
        print(missing_hint, file=sys.stderr)
    print(json.dumps(data, indent=2))
