"""Set or show the CPU frequency governor on every CPU: the command line of the boot unit.

gptoss-cpu-governor.service runs ``python3 -m service.host.cpu_governor set <governor>`` at every
boot; the role sets it through the ``gptoss.host.cpu_governor`` module. Both call the collection's
``module_utils/cpu_governor.py`` (runs on the host's system python, stdlib only).
"""

from __future__ import annotations

import argparse
import json
import sys

from ansible_collections.gptoss.host.plugins.module_utils.cpu_governor import (  # noqa: F401 (re-exported)
    CPU_ROOT,
    GovernorError,
    apply,
    cpufreq_dirs,
    state,
)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="Set or show the CPU frequency governor on every CPU.")
    sub = parser.add_subparsers(dest="command", required=True)
    set_cmd = sub.add_parser("set", help="set GOVERNOR on every CPU and read it back")
    set_cmd.add_argument("governor")
    set_cmd.add_argument("--check", action="store_true", help="report what would change, change nothing")
    sub.add_parser("show", help="print the live governor of every CPU")
    args = parser.parse_args(argv)
    try:
        result = apply(args.governor, args.check) if args.command == "set" else state()
    except GovernorError as exc:
        raise SystemExit(f"error: {exc}") from None
    json.dump(result, sys.stdout)
    print()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
