"""Start vllm-router from /etc/gptoss/router.json, with the API key from the environment, not argv.

Runs with the router venv's python (`python -m service.venv.router_launch CONFIG`, PYTHONPATH=LIB).
vllm-router takes its worker key only as `--api-key` on the command line, where every user sees it in
ps. systemd reads the root-only EnvironmentFile and passes GPTOSS_ROUTER_API_KEY to this process; the
key goes straight into the router's own argument object, so it is neither in argv nor in the
world-readable config. `--check` runs the installed router's own parser on the config and exits:
the role calls it before writing the config, so a flag the pinned version does not know fails early.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

KEY_VARIABLE = "GPTOSS_ROUTER_API_KEY"


def load_argv(config_path: Path) -> list[str]:
    data = json.loads(config_path.read_text())
    argv = data.get("argv")
    if not isinstance(argv, list) or not all(isinstance(a, str) for a in argv):
        raise ValueError(f"{config_path}: 'argv' must be a list of strings")
    if any(a == "--api-key" or a.startswith("--api-key=") for a in argv):
        raise ValueError(f"{config_path}: the key does not belong in the config ({KEY_VARIABLE} carries it)")
    return argv


def main(args: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m service.venv.router_launch", description=__doc__.splitlines()[0])
    parser.add_argument("config", type=Path, help="router.json written by the router role")
    parser.add_argument("--check", action="store_true", help="parse with the installed router and exit")
    options = parser.parse_args(args)
    try:
        argv = load_argv(options.config)
    except (OSError, ValueError) as exc:
        print(f"router_launch: {exc}", file=sys.stderr)
        return 2
    # Imported late: --help and the config errors above work without the router installed.
    from vllm_router.launch_router import launch_router, parse_router_args

    router_args = parse_router_args(argv)  # the pinned router's own parser: exits 2 on an unknown flag
    if options.check:
        print(json.dumps({"policy": router_args.policy, "worker_urls": router_args.worker_urls,
                          "host": router_args.host, "port": router_args.port}))
        return 0
    router_args.api_key = os.environ.pop(KEY_VARIABLE, "") or None
    launch_router(router_args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
