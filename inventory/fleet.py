#!/usr/bin/env python3
"""Dynamic inventory for a lab fleet: the labs of `.lab/fleet-$GPTOSS_LAB.json` (`invoke lab.fleet-up`)."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from lab.fleet import inventory  # noqa: E402
from lab.inventory_script import main  # noqa: E402

if __name__ == "__main__":
    main(inventory, "fleet inventory: no fleet is up (run `invoke lab.fleet-up`)")
