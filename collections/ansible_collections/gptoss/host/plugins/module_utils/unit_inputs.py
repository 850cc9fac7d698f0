"""What a systemd unit reads, and whether the running process started with it.

Standard library only. One file, two users: the `vllm_change` Ansible module (through AnsiballZ) and
the host-side checks (gptoss_base ships module_utils to /opt/gptoss/lib with service/).
So the rollout and verify read the API key one way and decide "restart pending" one way.

The API key rule. systemd's EnvironmentFile= parser copies everything between single quotes as it
is: no escapes, no `$` expansion, no `#` comments, no specifiers. So the secrets file holds exactly
one line `VLLM_API_KEY='<key>'`, and the reader accepts only that form. A key that cannot be written
that way, or that an HTTP client cannot send unchanged in `Authorization: Bearer <key>`, is refused
before anything changes.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import socket
import subprocess
from typing import Any

from ansible_collections.gptoss.host.plugins.module_utils.loopback import is_loopback

API_KEY_NAME = "VLLM_API_KEY"
API_KEY_RULE = (
    "an API key must be printable ASCII (space to '~'), without a single quote ('), "
    "without leading or trailing spaces, and not empty: systemd passes such a key unchanged "
    "between single quotes, and HTTP sends it unchanged in 'Authorization: Bearer <key>'"
)
_SECRETS_LINE = re.compile(r"^VLLM_API_KEY='([^']*)'$")
NO_KEY_TEXT = "# no API key: loopback only\n"


class KeyFileError(Exception):
    """The secrets file is missing, unreadable or not in the one form this project writes."""


def port_number(value: Any) -> tuple[int | None, str]:
    """A TCP port from a setting: (port, "") or (None, why not) - the router's and monitoring's one rule."""
    try:
        port = int(value)
    except (TypeError, ValueError):
        return None, f"port {value!r} is not a number"
    if not 1 <= port <= 65535:
        return None, f"port {port} is outside 1-65535"
    return port, ""


def api_key_problem(key: str) -> str | None:
    """None when the key passes through systemd and HTTP unchanged, else what is wrong (never the key)."""
    if not key:
        return "the key is empty"
    bad = sorted({f"U+{ord(c):04X}" for c in key if not " " <= c <= "~"})
    if bad:
        return f"the key holds characters outside printable ASCII: {', '.join(bad)}"
    if "'" in key:
        return "the key holds a single quote (')"
    if key != key.strip(" "):
        return "the key starts or ends with a space (HTTP strips those)"
    return None


# Off loopback the server is reachable from the network: /v1/* must then need a key of this length.
MIN_EXPOSED_KEY_LENGTH = 16


def exposed_key_problem(key: str) -> str | None:
    """None when `key` ('' = none) may guard a server that the network reaches, else what to set (never
    the key). The reverse proxy asks this through the filter gptoss.host.exposed_key_problem."""
    if len(key) >= MIN_EXPOSED_KEY_LENGTH:
        return None
    have = "no key" if not key else f"a key of {len(key)} characters"
    return f"set vllm_service_api_key ({MIN_EXPOSED_KEY_LENGTH}+ characters, e.g. from ansible-vault; {have} given)"


def exposure_problem(host: str, key: str) -> str | None:
    """None when the server may listen on `host` with `key` ('' = none), else why not (never the key)."""
    problem = None if is_loopback(host) else exposed_key_problem(key)
    return problem and f"vllm_service_host={host} is not loopback: {problem} so /v1/* is not open to the network"


def secrets_file_text(key: str) -> str:
    """The secrets file for `key` ('' = no key). Raises ValueError with the rule for a refused key."""
    if not key:
        return NO_KEY_TEXT
    problem = api_key_problem(key)
    if problem:
        raise ValueError(f"vllm_service_api_key refused: {problem}; rule: {API_KEY_RULE}")
    return f"{API_KEY_NAME}='{key}'\n"


def parse_api_key(text: str) -> str | None:
    """The key in a secrets file's text; None for the no-key file. KeyFileError for any other form."""
    keys = []
    for number, line in enumerate(text.splitlines(), start=1):
        if not line.strip() or line.lstrip().startswith("#"):
            continue
        match = _SECRETS_LINE.match(line)
        if not match or api_key_problem(match.group(1)):
            raise KeyFileError(
                f"line {number} is not of the form VLLM_API_KEY='<key>' that this project writes "
                f"({API_KEY_RULE}); re-run the converge to rewrite it")
        keys.append(match.group(1))
    if len(keys) > 1:
        raise KeyFileError(f"{len(keys)} VLLM_API_KEY lines (want one)")
    return keys[0] if keys else None


def _read_secrets_text(path: str, what: str = "") -> str:
    """A secrets file's text (ASCII, as systemd reads it); a clear KeyFileError otherwise."""
    try:
        with open(path, encoding="ascii") as handle:
            return handle.read()
    except (OSError, UnicodeDecodeError) as exc:
        raise KeyFileError(f"cannot read {what}{path}: {getattr(exc, 'strerror', None) or exc}") from None


def read_api_key(path: str) -> str:
    """The key of a secrets file, as systemd hands it to the server. The caller never prints it."""
    text = _read_secrets_text(path, "API key file ")
    try:
        key = parse_api_key(text)
    except KeyFileError as exc:
        raise KeyFileError(f"{path}: {exc}") from None
    if key is None:
        raise KeyFileError(f"{path} has no {API_KEY_NAME} line")
    return key


# ------------------------------------------------------------------ other secrets files

# The same single-quote form for any secret a unit reads through EnvironmentFile= (the webui role's
# admin password, session key): one rule, so what one file refuses the other refuses too.
_ENV_NAME = re.compile(r"^[A-Z][A-Z0-9_]*$")
_ENV_LINE = re.compile(r"^([A-Z][A-Z0-9_]*)='([^']*)'$")


def env_file_text(values: dict[str, str]) -> str:
    """`NAME='value'` lines, sorted by name. ValueError naming the variable (never the value) for a
    name or value that systemd would not pass through unchanged."""
    lines = []
    for name in sorted(values):
        if not _ENV_NAME.match(name):
            raise ValueError(f"{name!r} is not an environment variable name (A-Z, 0-9, _)")
        problem = api_key_problem(str(values[name]))
        if problem:
            raise ValueError(f"{name} refused: {problem.replace('the key', 'the value')}; rule: "
                             f"{API_KEY_RULE.replace('an API key', 'a secret value')}")
        lines.append(f"{name}='{values[name]}'\n")
    return "".join(lines)


def parse_env_file(text: str) -> dict[str, str]:
    """The values of a file that env_file_text wrote; KeyFileError for any other line."""
    values: dict[str, str] = {}
    for number, line in enumerate(text.splitlines(), start=1):
        if not line.strip() or line.lstrip().startswith("#"):
            continue
        match = _ENV_LINE.match(line)
        if not match:
            raise KeyFileError(f"line {number} is not of the form NAME='<value>' that this project writes")
        values[match.group(1)] = match.group(2)
    return values


def read_env_file(path: str) -> dict[str, str]:
    """The values of a secrets file on disk. The caller never prints them."""
    text = _read_secrets_text(path)
    try:
        return parse_env_file(text)
    except KeyFileError as exc:
        raise KeyFileError(f"{path}: {exc}") from None


# ------------------------------------------------------------------ content of the inputs


def file_digest(path: str) -> str:
    """sha256 of a file's bytes, or 'absent'."""
    try:
        with open(path, "rb") as handle:
            return hashlib.sha256(handle.read()).hexdigest()
    except FileNotFoundError:
        return "absent"


def fingerprint(paths: list[str]) -> dict[str, str]:
    return {path: file_digest(path) for path in sorted(set(paths))}


def process_start_epoch(pid: int, proc: str = "/proc") -> float:
    """When `pid` started, in epoch seconds (boot time + the start tick in /proc/PID/stat)."""
    with open(f"{proc}/{pid}/stat") as handle:
        # The command name may hold spaces and parentheses: split after the last ')'.
        fields = handle.read().rsplit(")", 1)[1].split()
    start_ticks = int(fields[19])  # field 22 of stat(5); fields[0] here is field 3
    with open(f"{proc}/stat") as handle:
        boot = next(int(line.split()[1]) for line in handle if line.startswith("btime "))
    return boot + start_ticks / os.sysconf("SC_CLK_TCK")


def pending_changes(paths: list[str], main_pid: int, stamp_file: str) -> list[str]:
    """Inputs whose content on disk is not what the running process (main_pid) started with.

    The stamp, written after each gated start, holds the inputs' sha256 and the PID that started
    with them: that PID gives an exact content comparison. A process that systemd started on its own
    (a crash restart, a manual restart) has no stamp; then a file modified after the process
    started counts as pending, because the process cannot have read it.
    """
    if main_pid <= 0:
        return []
    current = fingerprint(paths)
    stamp = load_stamp(stamp_file)
    if stamp.get("main_pid") == main_pid and isinstance(stamp.get("inputs"), dict):
        started_with = stamp["inputs"]
        return [p for p, digest in current.items() if started_with.get(p) != digest]
    # /proc/stat's btime is whole seconds, so the start time is known to within 1 s; a file written
    # in that second counts as read (a false "pending" would restart a healthy server on every run).
    started_at = process_start_epoch(main_pid) + 1.0
    pending = []
    for path in current:
        try:
            modified = os.stat(path).st_mtime
        except FileNotFoundError:
            continue
        if modified > started_at:
            pending.append(path)
    return pending


def load_stamp(stamp_file: str) -> dict:
    try:
        with open(stamp_file) as handle:
            data = json.load(handle)
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}


def stamp_text(paths: list[str], main_pid: int) -> str:
    return json.dumps({"main_pid": main_pid, "inputs": fingerprint(paths)}, indent=2, sort_keys=True) + "\n"


# ------------------------------------------------------------------ systemd and sockets


def unit_show(unit: str, properties: tuple[str, ...]) -> dict[str, str]:
    proc = subprocess.run(["systemctl", "show", unit, "-p", ",".join(properties)],
                          capture_output=True, text=True, timeout=30, check=False)
    if proc.returncode != 0:
        raise RuntimeError(f"systemctl show {unit} failed: {proc.stderr.strip()}")
    return dict(line.split("=", 1) for line in proc.stdout.splitlines() if "=" in line)


# What a failed start's message shows of the unit's journal (vllm_change's rollback, rollout's waits).
JOURNAL_TAIL_LINES = 40


def journal_tail(unit: str, lines: int = JOURNAL_TAIL_LINES) -> list[str]:
    """The unit's last `lines` journal messages, without metadata ([] where journalctl cannot say):
    one reader for every message that explains a start that failed."""
    try:
        proc = subprocess.run(["journalctl", "--unit", unit, "--lines", str(lines), "--no-pager", "--output", "cat"],
                              capture_output=True, text=True, timeout=30, check=False)
    except (OSError, subprocess.TimeoutExpired):
        return []
    return proc.stdout.splitlines()


def _decode_address(hex_address: str) -> str:
    """/proc/net/tcp{,6} address (host byte order, 32-bit words) -> printable IP."""
    raw = bytes.fromhex(hex_address)
    words = b"".join(raw[i:i + 4][::-1] for i in range(0, len(raw), 4))
    return socket.inet_ntop(socket.AF_INET if len(raw) == 4 else socket.AF_INET6, words)


def _collides(listening: str, wanted: str) -> bool:
    """Whether a socket bound to `listening` keeps a server from binding `wanted` (same port)."""
    wildcard = {"0.0.0.0", "::"}
    if listening in wildcard or wanted in wildcard:
        return True
    if listening.startswith("::ffff:"):
        listening = listening.removeprefix("::ffff:")
    return listening == wanted


def _socket_inodes_listening(port: int, host: str, proc: str = "/proc") -> set[str]:
    """Inodes of listening TCP sockets on `port` that would collide with binding `host`."""
    try:
        wanted = socket.gethostbyname(host) if ":" not in host else host
    except OSError:
        wanted = host
    inodes = set()
    for table in ("tcp", "tcp6"):
        try:
            with open(f"{proc}/net/{table}") as handle:
                next(handle)
                for line in handle:
                    fields = line.split()
                    address, _, local_port = fields[1].partition(":")
                    listening = fields[3] == "0A" and int(local_port, 16) == port
                    if listening and _collides(_decode_address(address), wanted):
                        inodes.add(fields[9])
        except FileNotFoundError:
            continue
    return inodes


def port_holders(port: int, host: str = "0.0.0.0", proc: str = "/proc") -> dict[int, str]:
    """PID -> command name of each process listening where binding `host`:`port` would collide.

    A listening socket whose process we cannot see (another PID namespace sharing the network)
    is reported as PID -1.
    """
    inodes = _socket_inodes_listening(port, host, proc)
    if not inodes:
        return {}
    wanted = {f"socket:[{inode}]" for inode in inodes}
    holders: dict[int, str] = {}
    for entry in os.listdir(proc):
        if not entry.isdigit():
            continue
        try:
            for fd in os.listdir(f"{proc}/{entry}/fd"):
                if os.readlink(f"{proc}/{entry}/fd/{fd}") in wanted:
                    with open(f"{proc}/{entry}/comm") as handle:
                        holders[int(entry)] = handle.read().strip()
                    break
        except OSError:
            continue  # gone, or not ours to read
    return holders or {-1: "a process not visible from here"}


def pid_in_unit(pid: int, unit: str, proc: str = "/proc") -> bool:
    """Whether `pid` runs in `unit`'s cgroup (the server's own workers included)."""
    try:
        with open(f"{proc}/{pid}/cgroup") as handle:
            return any(line.rstrip("\n").split("/")[-1] == unit or f"/{unit}/" in line for line in handle)
    except OSError:
        return False


def port_conflict(port: int, unit: str, host: str = "0.0.0.0", proc: str = "/proc") -> str | None:
    """None when `host`:`port` is free or held only by `unit`'s processes; else who holds it."""
    others = {pid: name for pid, name in port_holders(port, host, proc).items()
              if not pid_in_unit(pid, unit, proc)}
    if not others:
        return None
    return ", ".join(f"PID {pid} ({name})" if pid > 0 else name for pid, name in sorted(others.items()))
