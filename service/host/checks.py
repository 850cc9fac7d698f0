"""The live-state checks behind ``invoke verify`` (runs on the host, stdlib only; pynvml optional).

Each check reads what a role promised from ``verify.d/<role>.json`` and compares it with live state
(/proc, /sys, systemd, NVML, the HTTP API). IDs are stable; docs/design.md lists them with their keys.
"""

from __future__ import annotations

import copy
import json
import shutil
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Callable
from functools import cached_property
from pathlib import Path
from typing import Any

from ansible_collections.gptoss.host.plugins.module_utils import (
    kernel_flags,
    listening_sockets,
    mountinfo,
    unit_inputs,
    venv_store,
    verify_contract,
    version_chain,
)

from service.host import gpu_exporter_check, monitoring_check, nvidia, rollout, router_check
from service.host.report import ReportRow

STATUSES = ("pass", "fail", "skip", "error")
DEFAULT_UNIT = "gptoss-vllm.service"
# systemd answers in milliseconds; a host under heavy load (a converge, a model copy) can take seconds.
SYSTEMCTL_TIMEOUT_S = 20
UNIT_PROPERTIES = ("MainPID", "ActiveState", "SubState", "UnitFileState", "NRestarts", "LoadState")


class ConfigError(Exception):
    """verify.d or a waiver file is unusable: the run cannot say anything true (exit 2)."""


# A check's result is a report row (service/host/report.py, the type preflight's items are too):
# CheckResult(id, title, status, expected, found, reason).
CheckResult = ReportRow


def load_roles(config_dir: Path) -> dict[str, verify_contract.RoleRecord]:
    """Every verify.d/<role>.json as {role: record}, each checked against the verify contract;
    ConfigError when the folder or a file is unusable or breaks the contract."""
    if not config_dir.is_dir():
        raise ConfigError(f"{config_dir}: not a directory (no role has written its expectations)")
    roles: dict[str, verify_contract.RoleRecord] = {}
    for path in sorted(config_dir.glob("*.json")):
        try:
            data = json.loads(path.read_text())
        except (OSError, UnicodeDecodeError, json.JSONDecodeError) as err:
            raise ConfigError(f"{path}: {err}") from err
        if not isinstance(data, dict):
            raise ConfigError(f"{path}: expected a JSON object, got {type(data).__name__}")
        try:
            roles[path.stem] = verify_contract.RoleRecord(path.stem, verify_contract.check_record(path.stem, data))
        except verify_contract.ContractError as err:
            raise ConfigError(f"{path}: {err}") from err
    return roles


class Context:
    """What the checks share: the role files, options, and live facts read once (lazily)."""

    def __init__(self, roles: dict[str, Any], *, no_completion: bool = False, timeout: float = 2.0,
                 main_pid: int | None = None, cpu_root: Path = Path("/sys/devices/system/cpu"),
                 mountinfo: Path = Path("/proc/self/mountinfo"), cmdline: Path = Path("/proc/cmdline")):
        # Records read through the contract (load_roles gives RoleRecords; tests may pass plain dicts).
        self.roles = {name: record if isinstance(record, verify_contract.RoleRecord)
                      else verify_contract.RoleRecord(name, record) for name, record in roles.items()}
        self.no_completion = no_completion
        self.timeout = timeout
        self._main_pid = main_pid  # tests pass a real child's pid; production asks systemd
        self.cpu_root = cpu_root
        self.mountinfo = mountinfo
        self.cmdline = cmdline
        self._unit_props: dict[str, str] | RuntimeError | None = None

    def role(self, name: str) -> verify_contract.RoleRecord:
        return self.roles[name]

    @property
    def unit(self) -> str:
        if "vllm_service" not in self.roles:
            return DEFAULT_UNIT
        return str(self.role("vllm_service").get("unit") or DEFAULT_UNIT)

    @cached_property
    def nvml(self) -> dict[str, Any]:
        return nvidia.nvml_snapshot()

    @cached_property
    def proc_driver(self) -> dict[str, Any]:
        return nvidia.read_proc_driver()

    @property
    def unit_props(self) -> dict[str, str]:
        """One `systemctl show` for every property the SVC/ENV checks need; raises RuntimeError.

        The answer, or the error, is kept: four checks ask, systemd is asked once."""
        if self._unit_props is None:
            try:
                self._unit_props = systemctl_show(self.unit, UNIT_PROPERTIES)
            except RuntimeError as err:
                self._unit_props = err
        if isinstance(self._unit_props, RuntimeError):
            raise self._unit_props
        return self._unit_props

    def main_pid(self) -> int:
        if self._main_pid is not None:
            return self._main_pid
        pid = int(self.unit_props.get("MainPID") or 0)
        if pid <= 0:
            raise LookupError(f"{self.unit} has no main process (MainPID=0: not running)")
        return pid


def systemctl_show(unit: str, properties: tuple[str, ...]) -> dict[str, str]:
    exe = shutil.which("systemctl")
    if exe is None:
        raise RuntimeError("systemctl not found: this host is not managed by systemd")
    argv = [exe, "show", *[f"-p{name}" for name in properties], unit]
    try:
        proc = subprocess.run(argv, capture_output=True, text=True, timeout=SYSTEMCTL_TIMEOUT_S, check=False)
    except subprocess.TimeoutExpired as err:
        raise RuntimeError(f"systemctl show timed out after {SYSTEMCTL_TIMEOUT_S} s") from err
    if proc.returncode != 0:
        message = (proc.stderr or proc.stdout).strip().splitlines()
        raise RuntimeError(f"systemctl show {unit} failed (exit {proc.returncode}): "
                           f"{message[0] if message else 'no output'}")
    props = dict(line.split("=", 1) for line in proc.stdout.splitlines() if "=" in line)
    if not props:
        raise RuntimeError(f"systemctl show {unit} printed no properties")
    return props


# ------------------------------------------------------------------ parsers of live files


def process_tree(root_pid: int, proc: Path = Path("/proc")) -> list[int]:
    """root_pid and all its descendants, from the ppid field of each /proc/PID/stat."""
    children: dict[int, list[int]] = {}
    for stat in proc.glob("[0-9]*/stat"):
        try:
            text = stat.read_text()
        except OSError:
            continue  # the process ended while we walked
        # comm may hold spaces and parentheses: the fields after the last ')' are fixed.
        ppid = int(text[text.rindex(")") + 2:].split()[1])
        children.setdefault(ppid, []).append(int(stat.parent.name))
    tree, todo = [], [root_pid]
    while todo:
        pid = todo.pop()
        tree.append(pid)
        todo.extend(children.get(pid, []))
    return sorted(tree)


def read_environ(pid: int, proc: Path = Path("/proc")) -> dict[str, str]:
    raw = (proc / str(pid) / "environ").read_bytes()
    if raw.startswith(b"\0"):
        # setproctitle moved the environment to make room for a longer title and zeroed the start
        # of the old area: what is left is a tail of it, not the environment. Report it unreadable.
        return {}
    env = {}
    for item in raw.split(b"\0"):
        key, sep, value = item.partition(b"=")
        if sep:
            env[key.decode(errors="replace")] = value.decode(errors="replace")
    return env


def read_api_key(path: str) -> str:
    """The key as systemd hands it to the server (the one reader, shared with the rollout)."""
    try:
        return unit_inputs.read_api_key(path)
    except unit_inputs.KeyFileError as err:
        raise LookupError(str(err)) from None



# ------------------------------------------------------------------ NVIDIA driver and GPUs


def _no_gpu(ctx: Context, cid: str, title: str, reason: str, expected: str = "") -> CheckResult:
    """No driver or NVML: skip, unless the role said a GPU is required."""
    status = "fail" if ctx.role("nvidia_driver").get("require_gpu", False) else "skip"
    return CheckResult(cid, title, status, expected, "", reason + ("" if status == "skip" else " (require_gpu)"))


def _driver_version(ctx: Context) -> tuple[str | None, str]:
    if ctx.proc_driver.get("loaded"):
        return ctx.proc_driver["driver_version"], f"{ctx.proc_driver['kernel_module']} kernel module"
    if ctx.nvml.get("available"):
        return str(ctx.nvml["driver_version"]), "from NVML"
    return None, ctx.proc_driver.get("reason", "no driver")


def check_driver_floor(ctx: Context) -> CheckResult:
    cid, title = "DRV-001", "NVIDIA driver >= project floor"
    floor = str(ctx.role("nvidia_driver").get("min_driver") or nvidia.PROJECT_DRIVER_FLOOR)
    version, note = _driver_version(ctx)
    if version is None:
        return _no_gpu(ctx, cid, title, note, f">= {floor}")
    ok = version_chain.version_tuple(version) >= version_chain.version_tuple(floor)
    return CheckResult(cid, title, "pass" if ok else "fail", f">= {floor}", version,
                       note if ok else f"driver {version} is older than the floor {floor}")


def derived_build_note(ctx: Context) -> str:
    """What the converge derived before the install, beside what the venv really holds."""
    derived = ctx.role("nvidia_driver").get("build")
    if not derived:
        return ""
    return (f"; the converge derived {derived.get('package')} {derived.get('version')} -> torch "
            f"{derived.get('torch_version')} -> CUDA {derived.get('cuda_version') or 'none (CPU build)'}")


def check_driver_for_cuda(ctx: Context) -> CheckResult:
    """The CUDA of the torch really installed in the service's venv against the running driver.

    Read from the venv's torch/version.py (what `torch.version.cuda` returns), never from the inventory."""
    cid, title = "DRV-002", "Driver supports the CUDA build"
    venv = ctx.role("nvidia_driver").get("vllm_venv")
    if not venv:
        return CheckResult(cid, title, "skip", "", "", "nvidia_driver.json names no vllm_venv")
    try:
        torch = version_chain.installed_torch(str(venv))
    except (OSError, SyntaxError, ValueError, version_chain.ChainError) as err:
        return CheckResult(cid, title, "error", "", "", f"torch in {venv}: {err}")
    if torch is None:
        return CheckResult(cid, title, "skip", "", "", f"no torch installed in {venv} (vllm_service not applied yet?)")
    build = f"torch {torch['torch_version']}"
    cuda = torch["cuda_version"]
    if not cuda:
        return CheckResult(cid, title, "skip", "", build, f"{build} is a CPU build: it needs no NVIDIA driver")
    try:
        needed = version_chain.minimum_driver_for_cuda(cuda)
    except ValueError as err:
        return CheckResult(cid, title, "error", f"CUDA {cuda}", build, str(err))
    expected = f"driver >= {needed}, NVML CUDA >= {cuda} ({build}, CUDA {cuda})" + derived_build_note(ctx)
    version, note = _driver_version(ctx)
    if version is None:
        return _no_gpu(ctx, cid, title, note, expected)
    problems = []
    if version_chain.version_tuple(version) < version_chain.version_tuple(needed):
        problems.append(f"{build} is a CUDA {cuda} build, which needs driver >= {needed}; found {version}")
    nvml_cuda = ctx.nvml.get("cuda_driver_version") if ctx.nvml.get("available") else None
    if isinstance(nvml_cuda, str) and nvml_cuda[:1].isdigit():
        if version_chain.version_tuple(nvml_cuda) < version_chain.version_tuple(cuda):
            problems.append(f"the driver's CUDA API is {nvml_cuda}, older than the build's {cuda}")
        cuda_note = f"NVML CUDA {nvml_cuda}"
    else:
        cuda_note = f"NVML CUDA version not read ({ctx.nvml.get('reason') or nvml_cuda})"
    found = f"driver {version}, {cuda_note}; {build} from {torch['version_file']}"
    return CheckResult(cid, title, "fail" if problems else "pass", expected, found, "; ".join(problems))


def _gpus_or_result(ctx: Context, cid: str, title: str, expected: str = "") -> list[dict] | CheckResult:
    if not ctx.nvml.get("available"):
        return _no_gpu(ctx, cid, title, f"NVML unavailable: {ctx.nvml.get('reason')}", expected)
    return ctx.nvml["gpus"]


def check_gpu_inventory(ctx: Context) -> CheckResult:
    cid, title = "GPU-001", "GPU count and model"
    role = ctx.role("nvidia_driver")
    want_count, want_name = role.get("gpu_count"), role.get("gpu_name_contains")
    expected = ", ".join(p for p in (f"{want_count} GPUs" if want_count is not None else ">= 1 GPU",
                                     f"name contains {want_name!r}" if want_name else "") if p)
    gpus = _gpus_or_result(ctx, cid, title, expected)
    if isinstance(gpus, CheckResult):
        return gpus
    names = [str(g["name"]) for g in gpus]
    found = f"{len(gpus)}: " + ", ".join(names) if gpus else "0 GPUs"
    problems = []
    if want_count is not None and len(gpus) != int(want_count):
        problems.append(f"expected {want_count} GPUs, NVML sees {len(gpus)}")
    if want_count is None and not gpus:
        problems.append("NVML sees no GPU")
    if want_name:
        problems += [f"GPU {g['index']} is {g['name']!r}" for g in gpus if str(want_name) not in str(g["name"])]
    return CheckResult(cid, title, "fail" if problems else "pass", expected, found, "; ".join(problems))


def check_persistence(ctx: Context) -> CheckResult:
    cid, title = "GPU-002", "Persistence mode on"
    gpus = _gpus_or_result(ctx, cid, title, "enabled on every GPU")
    if isinstance(gpus, CheckResult):
        return gpus
    off = [f"GPU {g['index']}: {g['persistence_mode']}" for g in gpus if g["persistence_mode"] != 1]
    found = ", ".join(f"GPU {g['index']}={'on' if g['persistence_mode'] == 1 else g['persistence_mode']}"
                      for g in gpus)
    return CheckResult(cid, title, "fail" if off else "pass", "enabled on every GPU", found,
                       ("not enabled: " + ", ".join(off)) if off else "")


def check_pcie_link(ctx: Context) -> CheckResult:
    """Rule: width must equal max width; a lower current gen with full width passes with a note,
    because idle GPUs drop the link to gen1 to save power and retrain under load."""
    cid, title = "GPU-003", "PCIe link at max gen/width"
    gpus = _gpus_or_result(ctx, cid, title, "current == max")
    if isinstance(gpus, CheckResult):
        return gpus
    found, problems, notes = [], [], []
    for g in gpus:
        gen, gen_max = g["pcie_gen_current"], g["pcie_gen_max"]
        width, width_max = g["pcie_width_current"], g["pcie_width_max"]
        found.append(f"GPU {g['index']}: gen{gen}/{gen_max} x{width}/{width_max}")
        if not all(isinstance(v, int) for v in (gen, gen_max, width, width_max)):
            problems.append(f"GPU {g['index']}: link not readable through NVML")
        elif width < width_max:
            problems.append(f"GPU {g['index']}: width x{width} below max x{width_max}")
        elif gen < gen_max:
            notes.append(f"GPU {g['index']}: gen{gen} < gen{gen_max} at full width (idle downtraining)")
    status = "fail" if problems else "pass"
    return CheckResult(cid, title, status, "width == max; gen == max (lower gen at idle noted)",
                       "; ".join(found), "; ".join(problems or notes))


def check_p2p(ctx: Context) -> CheckResult:
    cid, title = "GPU-004", "P2P status between GPU pairs"
    expected = str(ctx.role("nvidia_driver").get("p2p_expected", "any"))
    if expected not in ("supported", "unsupported", "any"):
        return CheckResult(cid, title, "error", expected, "", "p2p_expected must be supported/unsupported/any")
    gpus = _gpus_or_result(ctx, cid, title, expected)
    if isinstance(gpus, CheckResult):
        return gpus
    if len(gpus) < 2:
        return CheckResult(cid, title, "skip", expected, f"{len(gpus)} GPU", "P2P needs at least 2 GPUs")
    pairs = ctx.nvml["p2p"]
    found = ", ".join(f"{p['a']}<->{p['b']}: {p['status']}" for p in pairs)
    if expected == "any":
        return CheckResult(cid, title, "pass", expected, found, "reported only (p2p_expected: any)")
    want_ok = expected == "supported"
    wrong = [f"{p['a']}<->{p['b']} is {p['status']}" for p in pairs if (p["status"] == "ok") != want_ok]
    return CheckResult(cid, title, "fail" if wrong else "pass", expected, found, "; ".join(wrong))


# ------------------------------------------------------------------ kernel command line


def _expected_flags(ctx: Context) -> list[str]:
    return [str(flag) for flag in ctx.role("kernel_cmdline").get("flags", [])]


def check_cmdline_flags(ctx: Context) -> CheckResult:
    cid, title = "KRN-001", "nvidia.NVreg_* flags on /proc/cmdline"
    want = _expected_flags(ctx)
    expected = " ".join(want)
    if not want:
        return CheckResult(cid, title, "skip", "", "", "kernel_cmdline.json lists no flags")
    if ctx.role("kernel_cmdline").get("method") == "modprobe":
        # The flags went to /etc/modprobe.d as driver options: the kernel command line never has them.
        return CheckResult(cid, title, "skip", expected, "", "method modprobe: the flags are driver options "
                           "(KRN-002 reads them in /proc/driver/nvidia/params)")
    cmdline = ctx.cmdline.read_text()
    live = kernel_flags.parse_cmdline_flags(cmdline)
    found = " ".join(f"{key}={live[key]}" if key in live else f"{key} absent"
                     for key, _ in map(kernel_flags.split_flag, want))
    wrong = kernel_flags.flag_problems("grub", want, cmdline, None)
    reason = "; ".join(f"{kernel_flags.split_flag(f)[0]}: {why}" for f, why in wrong.items())
    return CheckResult(cid, title, "fail" if wrong else "pass", expected, found,
                       reason + (" (reboot pending?)" if wrong else ""))


def check_driver_params(ctx: Context) -> CheckResult:
    cid, title = "KRN-002", "Flags in effect in /proc/driver/nvidia/params"
    want = [f for f in _expected_flags(ctx) if f.startswith(kernel_flags.DRIVER_FLAG_PREFIX)]
    names = [kernel_flags.driver_param_name(kernel_flags.split_flag(f)[0]) for f in want]
    expected = " ".join(f"{name}={kernel_flags.split_flag(f)[1]}" for name, f in zip(names, want, strict=True))
    if not want:
        return CheckResult(cid, title, "skip", "", "", "no nvidia.NVreg_* flags expected")
    if not ctx.proc_driver.get("loaded"):
        return CheckResult(cid, title, "skip", expected, "", ctx.proc_driver.get("reason", "no driver"))
    params = ctx.proc_driver.get("params")
    if params is None:
        return CheckResult(cid, title, "error", expected, "", ctx.proc_driver.get("params_reason", ""))
    found = " ".join(f"{name}: {params.get(name, 'absent')}" for name in names)
    wrong = kernel_flags.flag_problems("modprobe", want, "", params)
    reason = "; ".join(f"{kernel_flags.driver_param_name(kernel_flags.split_flag(f)[0])}: {why}"
                       for f, why in wrong.items())
    return CheckResult(cid, title, "fail" if wrong else "pass", expected, found, reason)


# ------------------------------------------------------------------ mounts, CPU


def check_model_mount(ctx: Context) -> CheckResult:
    cid, title = "MNT-001", "Model mount, fstype and options"
    role = ctx.role("model_mount")
    point, fstype = str(role.get("mount_point", "")), role.get("fstype")
    options = [str(o) for o in role.get("options", [])]
    expected = f"{point} {fstype or '?'} " + ",".join(options)
    mount = mountinfo.mount_at(ctx.mountinfo.read_text(), point)
    if mount is None:
        return CheckResult(cid, title, "fail", expected, "not mounted", f"no mount at {point} in mountinfo")
    found = (f"{mount['source']} {mount['fstype']} {','.join(mount['mount_options'])}"
             f" | {','.join(mount['super_options'])}")
    problems = []
    if fstype and mount["fstype"] != fstype:
        problems.append(f"fstype {mount['fstype']} != {fstype}")
    problems += [f"option {o} missing" for o in mountinfo.missing_options(options, mount)]
    return CheckResult(cid, title, "fail" if problems else "pass", expected, found, "; ".join(problems))


def check_cpu_governor(ctx: Context) -> CheckResult:
    cid, title = "CPU-001", "CPU frequency governor"
    want = str(ctx.role("cpu_governor").get("governor", "performance"))
    files = sorted(ctx.cpu_root.glob("cpu[0-9]*/cpufreq/scaling_governor"), key=lambda p: int(p.parent.parent.name[3:]))
    if not files:
        return CheckResult(cid, title, "skip", want, "no cpufreq",
                           "cpufreq not supported on this machine (VM/container)")
    live = {f.parent.parent.name: f.read_text().strip() for f in files}
    wrong = [f"{cpu}={gov}" for cpu, gov in live.items() if gov != want]
    found = f"{len(live) - len(wrong)}/{len(live)} CPUs {want}"
    reason = ("other governor: " + ", ".join(wrong[:8]) + (" ..." if len(wrong) > 8 else "")) if wrong else ""
    return CheckResult(cid, title, "fail" if wrong else "pass", f"{want} on every CPU", found, reason)


# ------------------------------------------------------------------ service and environment


def check_nccl_env(ctx: Context) -> CheckResult:
    cid, title = "ENV-001", "NCCL variables in the running vLLM processes"
    variables = {str(k): str(v) for k, v in ctx.role("nccl_env").get("variables", {}).items()}
    reason = ctx.role("nccl_env").get("p2p_reason")
    expected = " ".join(f"{k}={v}" for k, v in variables.items()) + (f" (P2P: {reason})" if reason else "")
    if "vllm_service" not in ctx.roles:
        # A host that runs the tuning roles without the service (e.g. Debian 13, where the pinned
        # build has no wheels for its Python) has no process these variables could be read from.
        return CheckResult(cid, title, "skip", expected, "",
                           "no vLLM service on this host (verify.d/vllm_service.json absent)")
    try:
        main_pid = ctx.main_pid()
        pids = process_tree(main_pid)
    except (RuntimeError, LookupError) as err:
        return CheckResult(cid, title, "error" if isinstance(err, RuntimeError) else "fail", expected, "", str(err))
    problems, unreadable = [], []
    for pid in pids:
        try:
            env = read_environ(pid)
        except OSError:
            continue  # a worker that exited between the walk and the read
        if not env:
            # setproctitle ("VLLM::EngineCore") reuses the environ area for the longer title, so
            # /proc/PID/environ reads empty; these children inherit the main process's environment.
            unreadable.append(pid)
            continue
        for name, value in variables.items():
            if name not in env:
                problems.append(f"PID {pid}: {name} missing")
            elif env[name] != value:
                problems.append(f"PID {pid}: {name}={env[name]!r} (want {value!r})")
    if main_pid in unreadable:
        problems.append(f"PID {main_pid} (main): environment not readable")
    found = f"{len(pids) - len(unreadable)} of {len(pids)} process(es) read: " + ",".join(
        str(p) for p in pids if p not in unreadable)
    note = f"; retitled, environ not readable: {','.join(map(str, unreadable))}" if unreadable else ""
    return CheckResult(cid, title, "fail" if problems else "pass", expected, found,
                       ("; ".join(problems[:6]) + note).lstrip("; "))


def check_unit_state(ctx: Context) -> CheckResult:
    cid, title = "SVC-001", "vLLM unit active and enabled"
    expected = f"{ctx.unit} active, enabled"
    try:
        props = ctx.unit_props
    except RuntimeError as err:
        return CheckResult(cid, title, "error", expected, "", str(err))
    found = f"{props.get('ActiveState')} ({props.get('SubState')}), {props.get('UnitFileState') or 'no unit file'}"
    problems = []
    if props.get("LoadState") == "not-found":
        problems.append(f"{ctx.unit} is not installed")
    if props.get("ActiveState") != "active":
        problems.append(f"not active: {props.get('ActiveState')}")
    if props.get("UnitFileState") != "enabled":
        problems.append(f"not enabled: {props.get('UnitFileState') or 'unknown'}")
    return CheckResult(cid, title, "fail" if problems else "pass", expected, found, "; ".join(problems))


def check_restarts(ctx: Context) -> CheckResult:
    cid, title = "SVC-002", "vLLM unit restart count"
    limit = int(ctx.role("vllm_service").get("max_restarts", 3))
    try:
        count = ctx.unit_props.get("NRestarts", "")
    except RuntimeError as err:
        return CheckResult(cid, title, "error", f"<= {limit}", "", str(err))
    if not count.isdigit():
        return CheckResult(cid, title, "error", f"<= {limit}", count, "systemd did not report NRestarts")
    ok = int(count) <= limit
    return CheckResult(cid, title, "pass" if ok else "fail", f"<= {limit}", count,
                       "" if ok else f"restarted {count} times (crash loop?)")


def check_cmdline_matches(ctx: Context) -> CheckResult:
    cid, title = "SVC-003", "Running command line equals vllm-args"
    want = [str(a) for a in ctx.role("vllm_service").get("argv", [])]
    expected = f"{len(want)} args"
    try:
        pid = ctx.main_pid()
        live = (Path("/proc") / str(pid) / "cmdline").read_bytes().rstrip(b"\0").split(b"\0")
    except (RuntimeError, LookupError, OSError) as err:
        return CheckResult(cid, title, "error" if isinstance(err, RuntimeError) else "fail", expected, "", str(err))
    args = [a.decode(errors="replace") for a in live]
    found = f"PID {pid}, {len(args)} args"
    for i, (w, a) in enumerate(zip(want, args, strict=False)):
        if w != a:
            return CheckResult(cid, title, "fail", expected, found, f"arg {i}: running {a!r}, expected {w!r}")
    if len(want) != len(args):
        extra = args[len(want)] if len(args) > len(want) else want[len(args)]
        return CheckResult(cid, title, "fail", expected, found,
                           f"arg {min(len(want), len(args))}: {'extra' if len(args) > len(want) else 'missing'} "
                           f"{extra!r}")
    return CheckResult(cid, title, "pass", expected, found, "")


def check_restart_pending(ctx: Context) -> CheckResult:
    cid, title = "SVC-004", "Running vLLM started with the configuration on disk"
    role = ctx.role("vllm_service")
    inputs = [str(p) for p in role.get("inputs", [])]
    expected = f"{len(inputs)} input(s) unchanged since the process started"
    if not inputs:
        return CheckResult(cid, title, "skip", expected, "", "verify.d/vllm_service.json lists no inputs")
    try:
        pid = ctx.main_pid()
        pending = unit_inputs.pending_changes(inputs, pid, str(role.get("stamp_file", "")))
    except (RuntimeError, OSError) as err:
        return CheckResult(cid, title, "error", expected, "", str(err))
    except LookupError as err:
        return CheckResult(cid, title, "fail", expected, "", str(err))
    return CheckResult(cid, title, "fail" if pending else "pass", expected, f"PID {pid}",
                       f"restart pending: changed on disk since PID {pid} started: {', '.join(pending)}"
                       if pending else "")


def check_running_venv(ctx: Context) -> CheckResult:
    cid, title = "SVC-005", "Running vLLM comes from the venv pointer's target"
    role = ctx.role("vllm_service")
    pointer, venvs_dir = str(role.get("venv_pointer", "")), str(role.get("venvs_dir", ""))
    if not pointer or not venvs_dir:
        return CheckResult(cid, title, "skip", "", "", "verify.d/vllm_service.json names no venv pointer")
    target = venv_store.pointer_target(pointer)
    manifest = venv_store.read_manifest(target) if target else None
    expected = f"{pointer} -> {target or '(no pointer)'}" + (f" ({manifest.get('package')} {manifest.get('version')})"
                                                               if manifest else "")
    try:
        pid = ctx.main_pid()
        running = venv_store.venv_of_process(pid, venvs_dir)
    except (RuntimeError, OSError) as err:
        return CheckResult(cid, title, "error", expected, "", str(err))
    except LookupError as err:
        return CheckResult(cid, title, "fail", expected, "", str(err))
    running_manifest = venv_store.read_manifest(running) if running else None
    found = f"PID {pid} from {running or '(no versioned venv mapped)'}" + (
        f": {running_manifest.get('package')} {running_manifest.get('version')}" if running_manifest else "")
    if target is None:
        return CheckResult(cid, title, "fail", expected, found, f"{pointer} is not a symlink to a versioned venv")
    if running != target:
        return CheckResult(cid, title, "fail", expected, found,
                           f"the running server does not come from {target}: a pointer switch without the "
                           "restart behind the gate (or a manual change); converge or `invoke rollback`")
    return CheckResult(cid, title, "pass", expected, found, "")


# ------------------------------------------------------------------ HTTP API


# A completion is scheduled behind the requests the engine already holds; /health and /v1/models are
# answered by the API server alone. On a busy host a completion's wait is not a fault, so it gets at least
# this long, not the 2 s that suit /health. (A suite run on a loaded 2-core box once failed a verify of
# SVC-003, SVC-004 and API-003; of those, only API-003's limit depends on load.)
COMPLETION_TIMEOUT_S = 30.0


def _completion_timeout(ctx: Context) -> float:
    return max(ctx.timeout, COMPLETION_TIMEOUT_S)


def _http(ctx: Context, path: str, body: dict | None = None, auth: bool = True,
          timeout: float | None = None) -> tuple[int, bytes]:
    role = ctx.role("vllm_service")
    url = str(role.get("base_url", "http://127.0.0.1:8000")).rstrip("/") + path
    headers = {"Content-Type": "application/json"} if body is not None else {}
    if auth and role.get("api_key_file"):
        headers["Authorization"] = f"Bearer {read_api_key(str(role['api_key_file']))}"
    data = json.dumps(body).encode() if body is not None else None
    request = urllib.request.Request(url, data=data, headers=headers, method="POST" if body is not None else "GET")
    try:
        with urllib.request.urlopen(request, timeout=timeout or ctx.timeout) as response:
            return response.status, response.read()
    except urllib.error.HTTPError as err:
        return err.code, err.read()


def _api_result(ctx: Context, cid: str, title: str, expected: str,
                probe: Callable[[], CheckResult]) -> CheckResult:
    try:
        return probe()
    except (urllib.error.URLError, OSError, TimeoutError) as err:
        reason = getattr(err, "reason", err)
        return CheckResult(cid, title, "fail", expected, "no response", f"{reason}")
    except LookupError as err:
        return CheckResult(cid, title, "error", expected, "", str(err))


def check_health(ctx: Context) -> CheckResult:
    cid, title = "API-001", "GET /health"

    def probe() -> CheckResult:
        status, _ = _http(ctx, "/health", auth=False)
        return CheckResult(cid, title, "pass" if status == 200 else "fail", "HTTP 200", f"HTTP {status}", "")
    return _api_result(ctx, cid, title, "HTTP 200", probe)


def check_models(ctx: Context) -> CheckResult:
    cid, title = "API-002", "GET /v1/models lists the served model"
    name = str(ctx.role("vllm_service").get("served_model_name", ""))

    def probe() -> CheckResult:
        status, body = _http(ctx, "/v1/models")
        if status != 200:
            return CheckResult(cid, title, "fail", name, f"HTTP {status}",
                               "unauthorized: API key rejected" if status == 401 else "")
        ids = [str(m.get("id")) for m in json.loads(body).get("data", [])]
        ok = name in ids
        return CheckResult(cid, title, "pass" if ok else "fail", name, ", ".join(ids),
                           "" if ok else f"{name!r} not served")
    return _api_result(ctx, cid, title, name, probe)


def check_completion(ctx: Context) -> CheckResult:
    cid, title = "API-003", "One real completion"
    if ctx.no_completion:
        return CheckResult(cid, title, "skip", ">= 1 token", "", "--no-completion")
    name = str(ctx.role("vllm_service").get("served_model_name", ""))

    def probe() -> CheckResult:
        start = time.monotonic()
        # The gate's own request (one home): sampling left to the server, as for a client that sets none.
        status, body = _http(ctx, "/v1/completions", rollout.completion_body(name, "Hello", 8),
                             timeout=_completion_timeout(ctx))
        ms = (time.monotonic() - start) * 1000
        if status != 200:
            return CheckResult(cid, title, "fail", ">= 1 token", f"HTTP {status}", body[:200].decode(errors="replace"))
        reply = json.loads(body)
        tokens = int(reply.get("usage", {}).get("completion_tokens") or 0)
        ok = tokens >= 1
        return CheckResult(cid, title, "pass" if ok else "fail", ">= 1 token", f"{tokens} tokens in {ms:.0f} ms",
                           "" if ok else "the server answered with no tokens")
    return _api_result(ctx, cid, title, ">= 1 token", probe)


# A tool the API-004 request offers. A server with tool calling must answer with a well-formed call
# of it, or with a plain message; anything else (a call of an unknown tool, arguments that are not
# a JSON object, an empty message) is what a broken parser or chat template produces.
PROBE_TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Current weather in a city",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
    },
}


def classify_chat_message(message: Any, tool_names: set[str]) -> tuple[str, str]:
    """(kind, problem) of one chat completion message: kind "tool call" or "message"; problem "" if sound.

    A plain message has a `content` string, or, with content null, a `reasoning_content`/`reasoning`
    string (a reasoning parser moves gpt-oss's analysis channel there, and a short max_tokens can
    end inside it)."""
    if not isinstance(message, dict):
        return "", f"message is {type(message).__name__}, not an object"
    calls = message.get("tool_calls") or []
    if calls:
        for call in calls:
            function = call.get("function") if isinstance(call, dict) else None
            if not isinstance(function, dict) or function.get("name") not in tool_names:
                return "tool call", f"call of an unknown tool: {json.dumps(call)[:120]}"
            try:
                arguments = json.loads(function.get("arguments") or "")
            except (TypeError, json.JSONDecodeError):
                return "tool call", f"{function['name']}: arguments are not JSON: {function.get('arguments')!r:.80}"
            if not isinstance(arguments, dict):
                return "tool call", f"{function['name']}: arguments are not a JSON object"
        return "tool call", ""
    if isinstance(message.get("content"), str):  # "" too: a model may stop at once (EOS)
        return "message", ""
    if any(isinstance(message.get(key), str) for key in ("reasoning_content", "reasoning")):
        return "message", ""
    return "", "neither tool_calls nor a content string"


def check_chat(ctx: Context) -> CheckResult:
    cid, title = "API-004", "Chat completion (and a tool call where enabled)"
    role = ctx.role("vllm_service")
    tools_enabled = role.get("tool_calling") is True
    expected = "assistant message" + (" + tool call or message" if tools_enabled else "")
    if ctx.no_completion:
        return CheckResult(cid, title, "skip", expected, "", "--no-completion")
    name = str(role.get("served_model_name", ""))
    messages = [{"role": "user", "content": "What is the weather in Paris?"}]

    def ask(extra: dict[str, Any]) -> tuple[dict[str, Any] | None, str]:
        status, body = _http(ctx, "/v1/chat/completions", {"model": name, "messages": messages, **extra},
                             timeout=_completion_timeout(ctx))
        if status != 200:
            return None, f"HTTP {status}: {body[:200].decode(errors='replace')}"
        reply = json.loads(body)
        choices = reply.get("choices") or [{}]
        return reply, "" if choices[0].get("message") is not None else "no message in the answer"

    def probe() -> CheckResult:
        start = time.monotonic()
        reply, problem = ask({"max_tokens": 8, "temperature": 0})
        ms = (time.monotonic() - start) * 1000
        if reply is None or problem:
            return CheckResult(cid, title, "fail", expected, "chat", problem)
        tokens = int(reply.get("usage", {}).get("completion_tokens") or 0)
        kind, problem = classify_chat_message(reply["choices"][0]["message"], set())
        found = f"chat: {tokens} tokens in {ms:.0f} ms"
        if problem or kind != "message" or tokens < 1:
            return CheckResult(cid, title, "fail", expected, found, problem or "the server answered with no tokens")
        if not tools_enabled:
            return CheckResult(cid, title, "pass", expected, found, "")
        # temperature 0: the same server gives the same answer on every run of verify.
        reply, problem = ask({"max_tokens": 16, "temperature": 0, "tools": [PROBE_TOOL], "tool_choice": "auto"})
        if reply is None or problem:
            return CheckResult(cid, title, "fail", expected, f"{found}; tools", problem)
        kind, problem = classify_chat_message(reply["choices"][0]["message"], {PROBE_TOOL["function"]["name"]})
        found += f"; tools: {kind or 'no answer'}"
        return CheckResult(cid, title, "fail" if problem else "pass", expected, found, problem)

    return _api_result(ctx, cid, title, expected, probe)


# ------------------------------------------------------------------ model weights


def check_model_weights(ctx: Context) -> CheckResult:
    cid, title = "MDL-001", "Weights are sound safetensors"
    from service.host.safetensors_check import check_safetensors_dir  # another module; only this check needs it

    model_dir = Path(str(ctx.role("model_weights").get("model_dir", "")))
    problems = check_safetensors_dir(model_dir)
    if model_dir.is_dir() and not list(model_dir.glob("*.safetensors")):
        problems += [f"{p.name}: pickle weights without safetensors" for p in sorted(model_dir.glob("*.bin"))
                     + sorted(model_dir.glob("*.pt"))]
    count = len(list(model_dir.glob("*.safetensors"))) if model_dir.is_dir() else 0
    return CheckResult(cid, title, "fail" if problems else "pass", f"{model_dir}: safetensors, headers valid",
                       f"{count} .safetensors files", "; ".join(problems[:5]))


def check_router(ctx: Context) -> CheckResult:
    """The router lists exactly the workers the inventory names (verify.d/router.json: its config)."""
    cid, title = "RTR-001", "Router lists every worker of the inventory"
    config = json.loads(Path(str(ctx.role("router").get("config_file", "/etc/gptoss/router.json"))).read_text())
    result = router_check.check(config)
    expected = " ".join(config["workers"])
    if "error" in result:
        return CheckResult(cid, title, "fail", expected, "no answer", result["error"])
    reason = "; ".join(f"{what}: {' '.join(urls)}" for what in ("missing", "unexpected") if (urls := result[what]))
    return CheckResult(cid, title, "pass" if result["ok"] else "fail", expected, " ".join(result["workers"]), reason)
# ------------------------------------------------------------------ monitoring (monitoring role)

MONITORING_ERRORS = (OSError, urllib.error.URLError, ValueError, KeyError)


def _ask_monitoring(ctx: Context, cid: str, title: str, url: str, want: str, what: str,
                    ask: Callable[[str], dict[str, Any]]) -> tuple[dict[str, Any], CheckResult | None]:
    """(the API's answer, None), or (None-like, the row to report): skip on a fleet member (Prometheus and
    Alertmanager run on the server host, where the check runs), fail when the API does not answer."""
    if not url:
        server = ctx.role("monitoring").get("server", "?")
        return {}, CheckResult(cid, title, "skip", "", "", f"scraped by the Prometheus on {server}")
    try:
        return ask(url), None
    except MONITORING_ERRORS as err:
        return {}, CheckResult(cid, title, "fail", want, "no answer", f"{what} at {url}: {err}")


def check_prometheus_targets(ctx: Context) -> CheckResult:
    """Prometheus answers and every target the role configured is up (its last scrape succeeded)."""
    cid, title = "MON-001", "Prometheus up, every expected target up"
    role = ctx.role("monitoring")
    expected = [str(t) for t in role.get("expected_targets", [])]
    want = f"{len(expected)} targets up"
    found, row = _ask_monitoring(ctx, cid, title, str(role.get("prometheus_url", "")), want, "Prometheus",
                                 lambda url: monitoring_check.targets(url, expected, max(ctx.timeout, 5.0)))
    if row:
        return row
    reason = "; ".join([f"down: {key} ({error})" for key, error in found["down"].items()]
                       + [f"not configured in the running Prometheus: {key}" for key in found["missing"]])
    ok = not found["down"] and not found["missing"]
    return CheckResult(cid, title, "pass" if ok else "fail", want, f"{len(found['up'])} up: {', '.join(found['up'])}",
                       reason)


def check_prometheus_rules(ctx: Context) -> CheckResult:
    """Every rule file the role wrote is loaded, no rule fails to evaluate, no configuration waits for a reload."""
    cid, title = "MON-002", "Rules loaded, no evaluation errors"
    role = ctx.role("monitoring")
    files = [str(f) for f in role.get("rule_files", [])]
    inputs = [str(p) for p in role.get("inputs", [])]
    want = f"{len(files)} rule file(s) loaded, no rule failing, no reload pending"
    found, row = _ask_monitoring(ctx, cid, title, str(role.get("prometheus_url", "")), want, "Prometheus",
                                 lambda url: monitoring_check.rules(url, files, inputs, max(ctx.timeout, 5.0)))
    if row:
        return row
    reason = "; ".join([f"not loaded: {f}" for f in found["not_loaded"]]
                       + [f"failing: {name}: {error}" for name, error in found["failing"].items()]
                       + [f"changed since the last reload: {f}" for f in found["reload_pending"]]
                       + [f"missing: {f}" for f in found["missing_inputs"]])
    return CheckResult(cid, title, "fail" if reason else "pass", want,
                       f"{found['groups']} groups, {found['rules']} rules", reason)


def check_alertmanager(ctx: Context) -> CheckResult:
    """Alertmanager answers, and its running configuration holds every receiver the role configured."""
    cid, title = "MON-003", "Alertmanager up with the configured receiver"
    role = ctx.role("monitoring")
    receivers = [str(r) for r in role.get("receivers", [])]
    config_file = str(role["alertmanager_config_file"])  # required by the record contract (the loader checks)
    want = ", ".join(receivers) or "no receiver"
    found, row = _ask_monitoring(ctx, cid, title, str(role.get("alertmanager_url", "")), want, "Alertmanager",
                                 lambda url: monitoring_check.alertmanager(url, receivers, config_file,
                                                                           max(ctx.timeout, 5.0)))
    if row:
        return row
    problems = [found["file_error"]] if found["file_error"] else []
    if not found["running_is_file"] and not found["file_error"]:
        problems.append(f"the running configuration is not {config_file} (changed since the last reload?)")
    problems += [f"receiver not in {config_file}: {r}" for r in found["missing"]]
    reason = "; ".join(problems)
    if not receivers:
        reason = "no receiver configured: alerts go nowhere"
    return CheckResult(cid, title, "fail" if reason else "pass", want,
                       f"Alertmanager {found['version']} (cluster {found['cluster']})", reason)


def check_gpu_exporter(ctx: Context) -> CheckResult:
    """The exporter's GPU count and NVML state against NVML's, read here through the same reader; where
    neither sees NVML (no driver: the lab) it skips as the GPU checks do (fails where require_gpu)."""
    cid, title = "MON-004", "GPU exporter agrees with NVML's GPU count"
    url = str(ctx.role("gpu_exporter")["metrics_url"])
    nvml = ctx.nvml
    expected = f"{nvml['gpu_count']} GPU(s), gptoss_nvml_up 1" if nvml.get("available") else "NVML's view"
    try:
        view = gpu_exporter_check.scrape(url, max(ctx.timeout, 5.0))
    except (OSError, urllib.error.URLError, ValueError) as err:
        return CheckResult(cid, title, "fail", expected, "no answer", f"{url}: {err}")
    status, reason = gpu_exporter_check.compare(view, nvml)
    found = gpu_exporter_check.describe(view) if view["up"] is not None and view["count"] is not None else "?"
    if status == "no_nvml":
        if "nvidia_driver" in ctx.roles:  # its require_gpu decides, as for GPU-001..004
            result = _no_gpu(ctx, cid, title, reason, expected)
            result.found = found
            return result
        status = "skip"
    return CheckResult(cid, title, status, expected, found, reason)


# ------------------------------------------------------------------ chat UI (webui role)

# Sign-in hashes the password and the model list asks the upstream: slower than a bare /health.
WEBUI_TIMEOUT_S = 15.0


def _webui_json(url: str, timeout: float, body: dict | None = None, token: str = "") -> Any:
    headers = {"Content-Type": "application/json"} if body is not None else {}
    if token:
        headers["Authorization"] = f"Bearer {token}"
    data = json.dumps(body).encode() if body is not None else None
    request = urllib.request.Request(url, data=data, headers=headers, method="POST" if body is not None else "GET")
    with urllib.request.urlopen(request, timeout=timeout) as response:
        return json.loads(response.read() or b"null")


def check_webui(ctx: Context) -> CheckResult:
    """The UI answers, the admin signs in, and the UI's own model list holds the served model."""
    cid, title = "WEB-001", "Open WebUI signs the admin in and lists the served model"
    role = ctx.role("webui")
    want = str(ctx.role("vllm_service").get("served_model_name", "")) if "vllm_service" in ctx.roles else ""
    base = str(role.get("base_url", "http://127.0.0.1:8080")).rstrip("/")
    timeout = max(ctx.timeout, WEBUI_TIMEOUT_S)
    try:
        secrets = unit_inputs.read_env_file(str(role.get("secrets_file", "")))
        email, password = secrets["WEBUI_ADMIN_EMAIL"], secrets["WEBUI_ADMIN_PASSWORD"]
    except (unit_inputs.KeyFileError, KeyError) as err:
        return CheckResult(cid, title, "error", want, "", f"admin account unreadable: {err}")
    step = "GET /health"
    try:
        _webui_json(f"{base}/health", timeout)
        step = "sign-in as the admin"
        token = _webui_json(f"{base}/api/v1/auths/signin", timeout, {"email": email, "password": password})["token"]
        step = "GET /api/models"
        ids = [str(m.get("id")) for m in _webui_json(f"{base}/api/models", timeout, token=token).get("data", [])]
    except urllib.error.HTTPError as err:
        return CheckResult(cid, title, "fail", want, f"HTTP {err.code}", f"{step} refused")
    except (urllib.error.URLError, OSError, TimeoutError, ValueError, KeyError, TypeError, AttributeError) as err:
        return CheckResult(cid, title, "fail", want, "no usable answer", f"{step}: {getattr(err, 'reason', err)}")
    ok = bool(want) and want in ids
    return CheckResult(cid, title, "pass" if ok else "fail", want, ", ".join(ids) or "no models",
                       "" if ok else f"{want!r} not listed by the UI (upstream unreachable or key refused?)")


# ------------------------------------------------------------------ network exposure (issue 27)


def cgroup2_root(mountinfo_path: Path = Path("/proc/self/mountinfo")) -> Path | None:
    """Where the cgroup2 hierarchy is mounted: /sys/fs/cgroup (unified), /sys/fs/cgroup/unified (hybrid)."""
    try:
        mounts = mountinfo.parse(mountinfo_path.read_text())
    except OSError:
        return None
    return next((Path(m["mount_point"]) for m in mounts if m["fstype"] == "cgroup2"), None)


def unit_pids(main_pid: int, unit: str, proc: Path = Path("/proc"), cgroup_root: Path | None = None) -> list[int]:
    """Every process of the unit: the unit's cgroup (v2, sub-cgroups included) found from MainPID, so a
    process that left the tree is still seen; the MainPID process tree where MainPID is not in a cgroup
    of that unit's name (no systemd) or the cgroup cannot be read."""
    cgroup_root = cgroup_root or cgroup2_root() or Path("/sys/fs/cgroup")
    try:
        lines = (proc / str(main_pid) / "cgroup").read_text().splitlines()
        path = next(line.split(":", 2)[2] for line in lines if line.startswith("0::"))
        if unit not in path.split("/"):
            raise LookupError(path)
        # 0: a process of another PID namespace in the same cgroup (labs sharing one hybrid hierarchy).
        pids = {int(pid) for procs in (cgroup_root / path.lstrip("/")).rglob("cgroup.procs")
                for pid in procs.read_text().split() if pid != "0"}
    except (OSError, StopIteration, ValueError, LookupError):
        pids = set()
    return sorted(pids) if main_pid in pids else process_tree(main_pid, proc)


def _resolve(host: str) -> set[str]:
    try:
        return {info[4][0] for info in socket.getaddrinfo(host, None, proto=socket.IPPROTO_TCP)} | {host}
    except OSError:
        return {host}


def _listing(items: list[listening_sockets.Listener]) -> str:
    """'tcp 127.0.0.1: 33015,41237 (VLLM::Worker)' per protocol, address and command."""
    groups: dict[tuple[str, str, str], list[int]] = {}
    for item in items:
        groups.setdefault((item.proto.rstrip("6"), item.address, item.comm), []).append(item.port)
    return "; ".join(f"{proto} {address}: {','.join(map(str, sorted(ports)))} ({comm})"
                     for (proto, address, comm), ports in sorted(groups.items()))


def check_listening_sockets(ctx: Context) -> CheckResult:
    """Every listening socket (TCP and UDP) of the unit's processes, from /proc: only the API may be
    reachable beyond loopback; vLLM's internal traffic (gloo, stores, NCCL bootstrap) stays on loopback
    and, where the service address is a loopback address of its own (the lab), off that address."""
    cid, title = "NET-001", "vLLM listens beyond loopback only on its API port"
    url = urllib.parse.urlsplit(str(ctx.role("vllm_service").get("base_url", "http://127.0.0.1:8000")))
    host, port = url.hostname or "127.0.0.1", url.port or 80
    expected = f"API tcp {host}:{port}; every other listening socket on loopback, none on {host}" if \
        host not in listening_sockets.INTERNAL_LOOPBACK else f"API tcp {host}:{port}; every other socket on loopback"
    try:
        pids = unit_pids(ctx.main_pid(), ctx.unit)
    except (RuntimeError, LookupError) as err:
        return CheckResult(cid, title, "error" if isinstance(err, RuntimeError) else "fail", expected, "", str(err))
    listeners, unreadable = listening_sockets.listeners_of(pids)
    api, offenders = listening_sockets.judge(listeners, _resolve(host), port)
    problems = listening_sockets.describe(offenders)
    if not api:
        problems.insert(0, f"nothing of {ctx.unit} listens on the API address {host}:{port}")
    others = [item for item in listeners if item not in api]
    found = (f"{len(pids)} process(es); API: {_listing(api) or 'none'}; "
             f"{len(others)} other: {_listing(others) or 'none'}")
    note = f"; not readable (gone?): PID {','.join(map(str, unreadable))}" if unreadable else ""
    return CheckResult(cid, title, "fail" if problems else "pass", expected, found,
                       ("; ".join(problems[:8]) + (f" (+{len(problems) - 8} more)" if len(problems) > 8 else "")
                        + note).lstrip("; "))


# The probe the transient units run: exit 0 connected, 3 refused (errno printed), 4 timed out.
FIREWALL_PROBE = """import socket, sys
try:
    socket.create_connection(("127.0.0.1", int(sys.argv[1])), timeout=float(sys.argv[2])).close()
except socket.timeout:
    sys.exit(4)
except OSError as err:
    print(f"{type(err).__name__} errno {err.errno}: {err.strerror}")
    sys.exit(3)
"""
FIREWALL_PROBE_TIMEOUT_S = 3.0


def _transient_probe(listener: socket.socket, properties: list[str]) -> tuple[int, str, bool]:
    """(exit status, output, whether the listener received a connection) of one throwaway unit
    that tries to connect to `listener`; the unit is collected whatever happens."""
    port = listener.getsockname()[1]
    argv = ["systemd-run", "--wait", "--pipe", "--quiet", "--collect",
            *[f"--property={p}" for p in properties], "--", sys.executable, "-c", FIREWALL_PROBE,
            str(port), str(FIREWALL_PROBE_TIMEOUT_S)]
    proc = subprocess.run(argv, capture_output=True, text=True, timeout=SYSTEMCTL_TIMEOUT_S + 10,
                          stdin=subprocess.DEVNULL, check=False)
    received = False
    try:
        while True:
            listener.accept()[0].close()
            received = True
    except BlockingIOError:
        pass
    return proc.returncode, (proc.stdout + proc.stderr).strip(), received


def _firewall_hint(ctx: Context) -> str:
    """The likeliest cause, from live state: systemd's firewall needs its own cgroup hierarchy on cgroup2
    (systemd's bpf-firewall.c: "Not running with unified cgroup hierarchy, BPF firewalling is not supported")."""
    try:
        top = mountinfo.mount_at(ctx.mountinfo.read_text(), "/sys/fs/cgroup")
    except OSError:
        top = None
    try:
        virt = subprocess.run(["systemd-detect-virt", "--container"], capture_output=True, text=True,
                              timeout=10, check=False).stdout.strip()
    except (OSError, subprocess.TimeoutExpired):
        virt = ""
    where = f"container: {virt}" if virt and virt != "none" else "not a container"
    if top is not None and top["fstype"] != "cgroup2":
        return (f"/sys/fs/cgroup is {top['fstype']}, not cgroup2: systemd runs on the legacy or hybrid cgroup "
                f"hierarchy, where it has no BPF firewall ({where})")
    return (f"/sys/fs/cgroup is cgroup2, yet systemd found no BPF firewall (the kernel or the container refused "
            f"its cgroup BPF program; the journal notes 'does not support BPF/cgroup firewalling' once; {where})")


def check_ip_firewall(ctx: Context) -> CheckResult:
    """Whether systemd's IP firewall (IPAddressDeny=, a BPF program on the unit's cgroup) blocks on this
    host: a throwaway unit without it must connect to a loopback listener of ours, one with
    IPAddressDeny=any must not. Runs where the UI runs: its unit relies on IPAddressDeny=any."""
    cid, title = "NET-002", "systemd's IPAddressDeny= really blocks (the UI's egress wall)"
    expected = "a unit with IPAddressDeny=any cannot connect to 127.0.0.1; without it, it can"
    if shutil.which("systemd-run") is None:
        return CheckResult(cid, title, "error", expected, "", "systemd-run not found")
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen(8)
        listener.setblocking(False)
        try:
            control = _transient_probe(listener, [])
            denied = _transient_probe(listener, ["IPAddressDeny=any"])
        except (OSError, subprocess.TimeoutExpired) as err:
            return CheckResult(cid, title, "error", expected, "", f"systemd-run: {err}")
    if control[0] != 0 or not control[2]:
        return CheckResult(cid, title, "error", expected, f"control unit: exit {control[0]}",
                           f"the probe did not connect even without IPAddressDeny, so it proves nothing: "
                           f"{control[1][-300:] or 'no output'}")
    if denied[0] == 0 or denied[2]:
        return CheckResult(cid, title, "fail", expected, "connected under IPAddressDeny=any",
                           "not enforced on this host: systemd attached no BPF IP filter to the unit (it says why "
                           f"only at debug level); {_firewall_hint(ctx)}; so IPAddressDeny=/IPAddressAllow= of "
                           "gptoss-webui.service are not in force here")
    how = {3: denied[1] or "refused", 4: f"no answer within {FIREWALL_PROBE_TIMEOUT_S:g} s"}.get(
        denied[0], f"exit {denied[0]}: {denied[1][-200:]}")
    return CheckResult(cid, title, "pass", expected, f"control connected; denied unit: {how}", "")


# ------------------------------------------------------------------ registry

# (id, title, role file that must exist, check). Order is the report order.
CHECKS: list[tuple[str, str, str, Callable[[Context], CheckResult]]] = [
    ("DRV-001", "NVIDIA driver >= project floor", "nvidia_driver", check_driver_floor),
    ("DRV-002", "Driver supports the CUDA build", "nvidia_driver", check_driver_for_cuda),
    ("GPU-001", "GPU count and model", "nvidia_driver", check_gpu_inventory),
    ("GPU-002", "Persistence mode on", "nvidia_driver", check_persistence),
    ("GPU-003", "PCIe link at max gen/width", "nvidia_driver", check_pcie_link),
    ("GPU-004", "P2P status between GPU pairs", "nvidia_driver", check_p2p),
    ("KRN-001", "nvidia.NVreg_* flags on /proc/cmdline", "kernel_cmdline", check_cmdline_flags),
    ("KRN-002", "Flags in effect in /proc/driver/nvidia/params", "kernel_cmdline", check_driver_params),
    ("MNT-001", "Model mount, fstype and options", "model_mount", check_model_mount),
    ("CPU-001", "CPU frequency governor", "cpu_governor", check_cpu_governor),
    ("ENV-001", "NCCL variables in the running vLLM processes", "nccl_env", check_nccl_env),
    ("SVC-001", "vLLM unit active and enabled", "vllm_service", check_unit_state),
    ("SVC-002", "vLLM unit restart count", "vllm_service", check_restarts),
    ("SVC-003", "Running command line equals vllm-args", "vllm_service", check_cmdline_matches),
    ("SVC-004", "Running vLLM started with the configuration on disk", "vllm_service", check_restart_pending),
    ("SVC-005", "Running vLLM comes from the venv pointer's target", "vllm_service", check_running_venv),
    ("API-001", "GET /health", "vllm_service", check_health),
    ("API-002", "GET /v1/models lists the served model", "vllm_service", check_models),
    ("API-003", "One real completion", "vllm_service", check_completion),
    ("API-004", "Chat completion (and a tool call where enabled)", "vllm_service", check_chat),
    ("MDL-001", "Weights are sound safetensors", "model_weights", check_model_weights),
    ("RTR-001", "Router lists every worker of the inventory", "router", check_router),
    ("WEB-001", "Open WebUI signs the admin in and lists the served model", "webui", check_webui),
    ("NET-001", "vLLM listens beyond loopback only on its API port", "vllm_service", check_listening_sockets),
    ("NET-002", "systemd's IPAddressDeny= really blocks (the UI's egress wall)", "webui", check_ip_firewall),
    ("MON-001", "Prometheus up, every expected target up", "monitoring", check_prometheus_targets),
    ("MON-002", "Rules loaded, no evaluation errors", "monitoring", check_prometheus_rules),
    ("MON-003", "Alertmanager up with the configured receiver", "monitoring", check_alertmanager),
    ("MON-004", "GPU exporter agrees with NVML's GPU count", "gpu_exporter", check_gpu_exporter),
]
CHECK_IDS = [cid for cid, _, _, _ in CHECKS]


# Checks about one serving unit: on a host with replica instances (verify.d/vllm_service@<name>.json,
# one per gptoss-vllm@<name>.service) they run once per instance, as <ID>@<name>.
PER_UNIT_CHECKS = {cid for cid, _, role, _ in CHECKS if role == "vllm_service"} | {"ENV-001"}


def instance_contexts(ctx: Context) -> list[tuple[str, Context]]:
    """(instance name, a Context whose vllm_service record is that instance's), in name order."""
    contexts = []
    for role in sorted(r for r in ctx.roles if r.startswith("vllm_service@")):
        sub = copy.copy(ctx)  # host-wide facts read once stay shared; the unit's own are read afresh
        sub.roles = {**ctx.roles, "vllm_service": ctx.roles[role]}
        sub._unit_props = None
        contexts.append((role.split("@", 1)[1], sub))
    return contexts


def _run_one(ctx: Context, cid: str, title: str, role: str, check) -> CheckResult:
    if role not in ctx.roles:
        return CheckResult(cid, title, "skip", "", "", f"role not applied (verify.d/{role}.json absent)")
    try:
        return check(ctx)
    except Exception as err:  # one broken check must not hide the others
        return CheckResult(cid, title, "error", "", "", f"{type(err).__name__}: {err}")


def run_checks(ctx: Context, only: set[str] | None = None) -> list[CheckResult]:
    """Every check (or those in `only`); a missing role file is skip, an unexpected exception is error."""
    results = []
    instances = instance_contexts(ctx) if "vllm_service" not in ctx.roles else []
    for cid, title, role, check in CHECKS:
        if only and cid not in only:
            continue
        if instances and cid in PER_UNIT_CHECKS:
            for name, sub in instances:
                result = _run_one(sub, cid, title, role, check)
                result.id, result.title = f"{cid}@{name}", f"{title} ({sub.unit})"
                results.append(result)
            continue
        results.append(_run_one(ctx, cid, title, role, check))
    return results
