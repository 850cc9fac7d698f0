#!/usr/bin/env python3
"""Dynamic inventory for the lab host: reads `.lab/$GPTOSS_LAB/state.json` (default lab: "default")."""

import json
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from lab.nspawn import inventory  # noqa: E402

if __name__ == "__main__":
    if "--host" in sys.argv:
        print("{}")
    else:
        data = inventory(os.environ.get("GPTOSS_LAB", "default"))
        if not data["lab"]["hosts"]:
            print("lab inventory: no lab is up (run `invoke lab.up`)", file=sys.stderr)
        print(json.dumps(data, indent=2))
