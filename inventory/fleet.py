#!/usr/bin/env python3
"""Dynamic inventory for a lab fleet: the labs of `.lab/fleet-$GPTOSS_LAB.json` (`invoke lab.fleet-up`)."""

import json
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from lab.fleet import inventory  # noqa: E402

if __name__ == "__main__":
    if "--host" in sys.argv:
        print("{}")
    else:
        data = inventory(os.environ.get("GPTOSS_LAB", "default"))
        if not data["lab"]["hosts"]:
            print("fleet inventory: no fleet is up (run `invoke lab.fleet-up`)", file=sys.stderr)
        print(json.dumps(data, indent=2))
