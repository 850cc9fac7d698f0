#!/usr/bin/env python3
"""Dynamic inventory for the lab host: reads `.lab/$GPTOSS_LAB/state.json` (default lab: "default")."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from lab.inventory_script import main  # noqa: E402
from lab.nspawn import inventory  # noqa: E402

if __name__ == "__main__":
    main(inventory, "lab inventory: no lab is up (run `invoke lab.up`)")
