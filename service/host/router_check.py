"""The router check: does the running router list exactly the workers its config (the inventory) names?

Standard library only (`python3 -m service.host.router_check --config /etc/gptoss/router.json`). Asks the
router's /list_workers and compares with the config's "workers" (module_utils router_config, the one
home of that rule). With --wait S it polls until they match or S seconds pass (the role's gate after
a start). Prints one JSON line; exit 0 match, 1 mismatch, 2 the router did not answer.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

from ansible_collections.gptoss.host.plugins.module_utils.router_config import compare_workers


def router_base_url(argv: list[str]) -> str:
    host = argv[argv.index("--host") + 1] if "--host" in argv else "127.0.0.1"
    port = argv[argv.index("--port") + 1] if "--port" in argv else "30000"
    return f"http://{'[' + host + ']' if ':' in host else host}:{port}"


def listed_workers(base_url: str, timeout: float = 5.0) -> list[str]:
    with urllib.request.urlopen(f"{base_url}/list_workers", timeout=timeout) as response:
        return list(json.load(response).get("urls", []))


def check(config: dict, base_url: str | None = None) -> dict:
    base_url = base_url or router_base_url(config["argv"])
    try:
        listed = listed_workers(base_url)
    except (OSError, urllib.error.URLError, ValueError) as exc:
        return {"ok": False, "router": base_url, "error": f"router did not answer: {exc}"}
    difference = compare_workers(config["workers"], listed)
    return {"ok": not difference["missing"] and not difference["unexpected"], "router": base_url,
            "workers": listed, **difference}


def main(args: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python3 -m service.host.router_check", description=__doc__.splitlines()[0])
    parser.add_argument("--config", type=Path, default=Path("/etc/gptoss/router.json"))
    parser.add_argument("--url", default=None, help="router base URL (default: from the config)")
    parser.add_argument("--wait", type=float, default=0.0, help="poll up to this many seconds for a match")
    options = parser.parse_args(args)
    config = json.loads(options.config.read_text())
    deadline = time.monotonic() + options.wait
    while True:
        result = check(config, options.url)
        if result["ok"] or time.monotonic() >= deadline:
            break
        time.sleep(1.0)
    print(json.dumps(result))
    return 0 if result["ok"] else (2 if "error" in result else 1)


if __name__ == "__main__":
    sys.exit(main())
