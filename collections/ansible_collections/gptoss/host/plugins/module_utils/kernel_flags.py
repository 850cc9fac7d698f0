"""Whether the kernel/driver flags a host was given are live: the one home of that rule.

Called by the ``gptoss.host.kernel_flags_live`` module (the role's "REBOOT REQUIRED" and its
reboot), by verify (KRN-001, KRN-002) and by preflight (KRN). A flag is ``key=value``:
- method ``grub``: live when /proc/cmdline has the key with that value (a later word wins, as
  the kernel applies them);
- method ``modprobe``: an ``nvidia.NVreg_<Name>=<value>`` flag is live when the loaded driver's
  /proc/driver/nvidia/params says the same thing. The driver prints numbers its own way
  (``0x...``), shows ~0 for a parameter nobody set, and packs a mode and a policy into
  ``EnableGpuFirmware``, so a plain string match would call an applied flag "pending" for ever.

Runs on the host's system python and in Ansible modules: standard library only.
"""

from __future__ import annotations

PROC_CMDLINE = "/proc/cmdline"
PROC_PARAMS = "/proc/driver/nvidia/params"
METHODS = ("grub", "modprobe")
DRIVER_FLAG_PREFIX = "nvidia.NVreg_"
# NV_REG_UNSET: the driver shows ~0 for a DWORD parameter nobody set (it then applies its default).
NVREG_UNSET = 4294967295
# EnableGpuFirmware packs a mode (low nibble: 0 off, 1 on, 2 default) and a policy (0x10 allow fallback).
GPU_FIRMWARE_MODE_MASK = 0x0F
GPU_FIRMWARE_MODES = {0: "disabled", 1: "enabled", 2: "default policy"}


def split_flag(flag: str) -> tuple[str, str]:
    key, _, value = str(flag).partition("=")
    return key, value


def driver_param_name(flag_key: str) -> str:
    """'nvidia.NVreg_EnableGpuFirmware' -> 'EnableGpuFirmware' (the name the params file uses)."""
    return flag_key.removeprefix("nvidia.").removeprefix("NVreg_")


def parse_cmdline_flags(text: str) -> dict[str, str]:
    """/proc/cmdline 'key=value' words -> {key: value}; a later word wins, as the kernel applies them."""
    flags: dict[str, str] = {}
    for word in text.split():
        key, _, value = word.partition("=")
        flags[key] = value
    return flags


def parse_driver_params(text: str) -> dict[str, str]:
    """'Name: value' lines of /proc/driver/nvidia/params -> {Name: value} (values kept as text)."""
    params: dict[str, str] = {}
    for line in text.splitlines():
        name, sep, value = line.partition(":")
        if sep and name.strip():
            params[name.strip()] = value.strip().strip('"')
    return params


def _number(value: str) -> int | None:
    try:
        return int(str(value), 0)
    except ValueError:
        return None


def compare_driver_param(name: str, want: str, live: str) -> str | None:
    """None when the driver's value means what the flag asked for, else why not."""
    live_n, want_n = _number(live), _number(want)
    if live_n is None or want_n is None:
        return None if live == want else f"{live!r} != {want!r}"
    if live_n == NVREG_UNSET:
        return f"{live} = unset (driver default), flag not applied"
    if name == "EnableGpuFirmware":
        mode = live_n & GPU_FIRMWARE_MODE_MASK
        return None if mode == want_n else \
            f"{live} = mode {mode} ({GPU_FIRMWARE_MODES.get(mode, '?')}), want mode {want_n}"
    return None if live_n == want_n else f"{live} != {want}"


def cmdline_problem(flag: str, cmdline: dict[str, str]) -> str | None:
    """None when /proc/cmdline has the flag's value, else why not."""
    key, want = split_flag(flag)
    if key not in cmdline:
        return "absent"
    return None if cmdline[key] == want else f"{cmdline[key]!r} (want {want!r})"


def driver_problem(flag: str, params: dict[str, str] | None) -> str | None:
    """None when the loaded driver applies the flag, else why not (params None: no driver loaded)."""
    key, want = split_flag(flag)
    if not key.startswith(DRIVER_FLAG_PREFIX):
        return f"not an {DRIVER_FLAG_PREFIX}* flag: method modprobe cannot apply it"
    if params is None:
        return "driver not loaded"
    name = driver_param_name(key)
    if name not in params:
        return "not in params"
    return compare_driver_param(name, want, params[name])


def flag_problems(method: str, flags: list[str], cmdline_text: str,
                  params: dict[str, str] | None) -> dict[str, str]:
    """flag -> why it is not live, for each flag that is not (empty: all live). ValueError: unknown method."""
    if method == "grub":
        live = parse_cmdline_flags(cmdline_text)
        found = {flag: cmdline_problem(flag, live) for flag in flags}
    elif method == "modprobe":
        found = {flag: driver_problem(flag, params) for flag in flags}
    else:
        raise ValueError(f"kernel flags method {method!r}: want one of {', '.join(METHODS)}")
    return {flag: why for flag, why in found.items() if why is not None}


def where_read(method: str, params: dict[str, str] | None) -> str:
    """Where the live state was read, for messages."""
    if method == "grub":
        return PROC_CMDLINE
    return PROC_PARAMS if params is not None else "no NVIDIA driver loaded"


def read_driver_params(path: str = PROC_PARAMS) -> dict[str, str] | None:
    """The loaded driver's parameters, None when it is not loaded (no such file)."""
    try:
        with open(path, encoding="utf-8", errors="replace") as handle:
            return parse_driver_params(handle.read())
    except FileNotFoundError:
        return None
