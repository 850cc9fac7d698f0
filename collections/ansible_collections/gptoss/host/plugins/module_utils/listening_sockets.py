"""Which sockets a set of processes listens on, read from /proc, and whether that is allowed.

Standard library only: verify (NET-001, the host's system python3) and the Ansible modules share it.

Live state, no ``ss``: a process's sockets are the ``socket:[INODE]`` links under ``/proc/PID/fd``;
``/proc/PID/net/{tcp,tcp6,udp,udp6}`` list every socket of that process's network namespace with its
inode, local address and state. A TCP socket listens in state 0A (LISTEN); a UDP socket receives from
anyone while it is not connected (state 07, remote port 0).

The rule (``judge``): a vLLM unit may listen beyond loopback on its API address and port only. Every
other socket (torch.distributed's gloo pairs and stores, NCCL's bootstrap, ZMQ) must be bound to a
loopback address, and not to the service address either unless that is 127.0.0.1 or ::1 itself: in
the lab the service address is a 127.x address of its own that stands for a real host's LAN address
(labs share one network namespace), so a socket there is what a LAN address would expose.
"""

from __future__ import annotations

import os
import socket
from dataclasses import dataclass

from ansible_collections.gptoss.host.plugins.module_utils.loopback import is_loopback

TABLES = ("tcp", "tcp6", "udp", "udp6")
TCP_LISTEN = "0A"
UDP_UNCONNECTED = "07"
WILDCARDS = ("0.0.0.0", "::")
# Loopback addresses that are the internal address itself, never a stand-in for a LAN address.
INTERNAL_LOOPBACK = ("127.0.0.1", "::1")


@dataclass(frozen=True)
class Listener:
    proto: str  # tcp, tcp6, udp, udp6 (the /proc/net table it was found in)
    address: str  # as bound; an IPv4-mapped IPv6 address is written as IPv4
    port: int
    inode: str
    pid: int = 0
    comm: str = ""

    @property
    def endpoint(self) -> str:
        host = f"[{self.address}]" if ":" in self.address else self.address
        return f"{self.proto.rstrip('6')} {host}:{self.port}"


def decode_address(hex_address: str) -> str:
    """/proc/net/{tcp,udp}{,6} address (host byte order, 32-bit words) -> printable IP."""
    raw = bytes.fromhex(hex_address)
    words = b"".join(raw[i:i + 4][::-1] for i in range(0, len(raw), 4))
    return socket.inet_ntop(socket.AF_INET if len(raw) == 4 else socket.AF_INET6, words)


def plain_address(address: str) -> str:
    """'::ffff:10.0.0.5' -> '10.0.0.5'; anything else unchanged."""
    return address.removeprefix("::ffff:") if address.startswith("::ffff:") and "." in address else address


def table_rows(text: str) -> list[tuple[str, int, str, int, str]]:
    """The rows of one /proc/net table: (local address, local port, state, remote port, inode)."""
    rows = []
    for line in text.splitlines()[1:]:
        fields = line.split()
        if len(fields) < 10:
            continue
        local_address, _, local_port = fields[1].partition(":")
        _, _, remote_port = fields[2].partition(":")
        rows.append((decode_address(local_address), int(local_port, 16), fields[3], int(remote_port, 16), fields[9]))
    return rows


def listening_in_table(text: str, proto: str) -> list[Listener]:
    """The listening sockets of one table: TCP in LISTEN, UDP unconnected (bound and receiving)."""
    found = []
    for address, port, state, remote_port, inode in table_rows(text):
        if proto.startswith("tcp") and state == TCP_LISTEN or (
                proto.startswith("udp") and state == UDP_UNCONNECTED and remote_port == 0):
            found.append(Listener(proto, plain_address(address), port, inode))
    return found


def socket_inodes(pid: int, proc: str = "/proc") -> set[str]:
    """Inodes of the sockets process `pid` holds open (OSError when it is gone or not ours to read)."""
    inodes = set()
    fd_dir = f"{proc}/{pid}/fd"
    for fd in os.listdir(fd_dir):
        try:
            target = os.readlink(f"{fd_dir}/{fd}")
        except OSError:
            continue  # closed while we looked
        if target.startswith("socket:["):
            inodes.add(target[len("socket:["):-1])
    return inodes


def _comm(pid: int, proc: str) -> str:
    try:
        with open(f"{proc}/{pid}/comm") as handle:
            return handle.read().strip()
    except OSError:
        return "?"


def listeners_of(pids: list[int], proc: str = "/proc") -> tuple[list[Listener], list[int]]:
    """Every listening socket the processes hold, each with the first PID holding it; and the PIDs
    that could not be read (gone meanwhile). Tables are read once per network namespace."""
    tables: dict[str, dict[str, Listener]] = {}  # network namespace -> inode -> listener
    found: dict[str, Listener] = {}
    unreadable = []
    for pid in sorted(pids):
        try:
            inodes = socket_inodes(pid, proc)
            try:
                netns = os.readlink(f"{proc}/{pid}/ns/net")
            except OSError:
                netns = f"pid:{pid}"  # no ns link to compare (tests' trees): read this process's own tables
            if netns not in tables:
                by_inode = {}
                for proto in TABLES:
                    try:
                        with open(f"{proc}/{pid}/net/{proto}") as handle:
                            text = handle.read()
                    except FileNotFoundError:
                        continue  # no IPv6 on this kernel
                    by_inode.update({item.inode: item for item in listening_in_table(text, proto)})
                tables[netns] = by_inode
        except OSError:
            unreadable.append(pid)
            continue
        for inode in sorted(inodes):
            if inode in tables[netns] and inode not in found:
                item = tables[netns][inode]
                found[inode] = Listener(item.proto, item.address, item.port, inode, pid, _comm(pid, proc))
    return sorted(found.values(), key=lambda s: (s.address, s.port, s.proto)), unreadable


def judge(listeners: list[Listener], service_addresses: set[str],
          api_port: int) -> tuple[list[Listener], list[tuple[Listener, str]]]:
    """(the API's sockets, every other socket that breaks the rule in the module's docstring with why).

    `service_addresses`: what the API's host resolves to (its --host); the API is the TCP socket on
    `api_port` bound to one of them (or to a wildcard when the service address is one)."""
    service = {plain_address(a) for a in service_addresses}
    api, offenders = [], []
    for item in listeners:
        if item.proto.startswith("tcp") and item.port == api_port and item.address in service:
            api.append(item)
        elif item.address in WILDCARDS:
            offenders.append((item, "bound to every address"))
        elif not is_loopback(item.address):
            offenders.append((item, "bound beyond loopback"))
        elif item.address in service and item.address not in INTERNAL_LOOPBACK:
            offenders.append((item, "on the service address, not the internal loopback"))
    return api, offenders


def describe(offenders: list[tuple[Listener, str]]) -> list[str]:
    """One line per protocol, address, process and verdict: 'tcp 127.127.24.1 ports 33101,34509
    (PID 3058 VLLM::Worker): on the service address, not the internal loopback'."""
    groups: dict[tuple[str, str, int, str, str], list[int]] = {}
    for item, verdict in offenders:
        groups.setdefault((item.proto.rstrip("6"), item.address, item.pid, item.comm, verdict), []).append(item.port)
    return [f"{proto} {address} port{'s' if len(ports) > 1 else ''} {','.join(map(str, sorted(ports)))} "
            f"(PID {pid} {comm}): {verdict}" for (proto, address, pid, comm, verdict), ports in groups.items()]
