"""Where a whole run's CPU went, by process tree, from the kernel's process accounting (acct v3).

The suite's record (tests/run_times.py) splits each test's CPU into the controller's and its labs';
it cannot say which programs inside either spent it. The kernel can: with accounting on
(`accton FILE`, package acct), every process that exits appends a 64-byte record with its pid,
parent pid, start time, user and system seconds and command name, whether it ran on the controller
or inside a lab (a lab's processes are the controller's too, in a child pid namespace).
`invoke test-times --pacct FILE` reads such a file and sums it by the trees this project runs:

- the controller's Ansible (ansible-playbook and the worker it forks per task) and ad hoc `ansible`;
- inside the labs (below `systemd-nspawn`): vLLM (a server and its engine and worker processes),
  what came in over SSH (Ansible's modules, the venv Python they start, pip), and other services;
- everything else on the controller, by command name.

A process's command name is the name of its last thread to exit (vLLM's worker often ends as
`gloo_tcp_loop`, its engine as `python`), so a vLLM tree is known by its top (the venv's `python`) or by
any of vLLM's names in it. Processes still running when accounting stops are not in the file.
"""

from __future__ import annotations

import struct
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

RECORD = struct.Struct("<BBHIIIIIIfHHHHHHHH16s")  # struct acct_v3 (include/uapi/linux/acct.h), 64 bytes
ACCT_VERSION_3 = 3
AHZ = 100  # acct's clock ticks per second
LAB_ROOT = "systemd-nspawn"
VLLM_NAMES = ("VLLM::", "gloo_tcp_loop", "pt_gloo_runloop", "ZMQbg/")


def comp_t(value: int) -> int:
    """acct's 16-bit float: a 13-bit mantissa and a 3-bit base-8 exponent."""
    return (value & 0x1FFF) << (3 * (value >> 13))


@dataclass
class Process:
    pid: int
    ppid: int
    born: int  # epoch seconds
    lived_s: float
    user_s: float
    sys_s: float
    comm: str
    parent: Process | None = field(default=None, repr=False)
    children: list[Process] = field(default_factory=list, repr=False)

    @property
    def cpu_s(self) -> float:
        return self.user_s + self.sys_s


def read(path: Path) -> list[Process]:
    """The v3 records of an accounting file, in the order the processes exited."""
    data = path.read_bytes()
    processes = []
    for offset in range(0, len(data) - RECORD.size + 1, RECORD.size):
        (_flag, version, _tty, _exit, _uid, _gid, pid, ppid, born, lived, user, system, _mem, _io, _rw,
         _minor, _major, _swaps, comm) = RECORD.unpack_from(data, offset)
        if version != ACCT_VERSION_3:
            raise ValueError(f"{path}: record {offset // RECORD.size} is acct version {version}, not 3")
        processes.append(Process(pid, ppid, born, lived / AHZ, comp_t(user) / AHZ, comp_t(system) / AHZ,
                                 comm.split(b"\0", 1)[0].decode(errors="replace")))
    return processes


def link_parents(processes: Sequence[Process]) -> None:
    """Pids are reused in a long run: a parent is the latest-born process with the child's parent pid
    that was born no later than the child and still alive when it was (1 s of slack: whole seconds)."""
    by_pid: dict[int, list[Process]] = {}
    for process in processes:
        by_pid.setdefault(process.pid, []).append(process)
    for child in processes:
        candidates = [p for p in by_pid.get(child.ppid, ()) if p is not child and p.born <= child.born
                      and p.born + p.lived_s + 1 >= child.born]
        if candidates:
            child.parent = max(candidates, key=lambda p: p.born)
            child.parent.children.append(child)


def ancestors(process: Process) -> list[Process]:
    """The process and its ancestors, nearest first (a cycle from a misread parent stops the walk)."""
    chain, seen = [], set()
    while process is not None and id(process) not in seen:
        seen.add(id(process))
        chain.append(process)
        process = process.parent
    return chain


def is_vllm(process: Process) -> bool:
    return process.comm.startswith(VLLM_NAMES)


def tree_has_vllm(top: Process) -> bool:
    stack = [top]
    while stack:
        process = stack.pop()
        if is_vllm(process):
            return True
        stack.extend(process.children)
    return False


def category(process: Process) -> str:
    chain = ancestors(process)
    names = [p.comm for p in chain]
    if LAB_ROOT in names:
        below = chain[:names.index(LAB_ROOT)]  # up to the lab's init, nearest first
        if len(below) < 2:
            return "lab: systemd-nspawn and the lab's init"
        top = below[-2]  # the service or session the lab's init started
        if top.comm == "sshd":
            # Ansible's modules run in the python3 of the Mitogen session; what they start is below it.
            if process.comm in ("python", "pip", "pip3"):
                return "lab: over SSH, venv Python and pip (vLLM's flag check, venv builds)"
            if process.comm in ("python3", "sshd"):
                return "lab: over SSH, Ansible's modules and sessions"
            return f"lab: over SSH, {process.comm}"
        # The vLLM unit starts the venv's `python` (the other services are Prometheus, exporters on the
        # system python3, Open WebUI, the router): its tree counts even when no process in it ended under
        # vLLM's names, as when the engine died first and its worker went to the lab's init.
        if top.comm == "python" or tree_has_vllm(top):  # the whole tree: the process is in it
            return "lab: vLLM servers (start and serve)"
        return f"lab: service {top.comm}"
    for name in names:
        if name.startswith("ansible-playboo"):  # the kernel keeps 15 characters
            return "controller: ansible-playbook and its task workers"
        if name == "ansible":
            return "controller: ansible (ad hoc)"
    return f"controller: {process.comm}"


@dataclass
class Share:
    cpu_s: float = 0.0
    sys_s: float = 0.0
    processes: int = 0


def by_category(processes: Iterable[Process]) -> dict[str, Share]:
    shares: dict[str, Share] = {}
    for process in processes:
        share = shares.setdefault(category(process), Share())
        share.cpu_s += process.cpu_s
        share.sys_s += process.sys_s
        share.processes += 1
    return shares


def summary(path: Path, top: int = 25) -> str:
    processes = read(path)
    link_parents(processes)
    shares = by_category(processes)
    total = sum(share.cpu_s for share in shares.values()) or 1.0
    system = sum(share.sys_s for share in shares.values())
    lines = [f"{path}: {len(processes)} processes, {total:,.0f} CPU-s ({system:,.0f} of it in the kernel)",
             f"{'CPU-s':>9} {'share':>6} {'kernel':>7} {'processes':>9}  tree"]
    ranked = sorted(shares.items(), key=lambda item: -item[1].cpu_s)
    for name, share in ranked[:top]:
        kernel_share = 100 * share.sys_s / max(share.cpu_s, 1e-9)
        lines.append(f"{share.cpu_s:9.1f} {100 * share.cpu_s / total:5.1f}% {kernel_share:6.0f}%"
                     f" {share.processes:9d}  {name}")
    rest = ranked[top:]
    if rest:
        lines.append(f"{sum(s.cpu_s for _, s in rest):9.1f} {100 * sum(s.cpu_s for _, s in rest) / total:5.1f}%"
                     f" {'':7} {sum(s.processes for _, s in rest):9d}  {len(rest)} smaller trees")
    for side in ("controller", "lab"):
        side_cpu = sum(s.cpu_s for name, s in shares.items() if name.startswith(side))
        lines.append(f"{side}: {side_cpu:,.0f} CPU-s")
    return "\n".join(lines)

