"""controller/acct_cpu.py: a run's CPU by process tree, from an accounting file in the kernel's own
acct v3 layout (written here record by record, as the kernel writes them)."""

from __future__ import annotations

import pytest

from controller import acct_cpu


def record(pid: int, ppid: int, born: int, comm: str, user_ticks: int = 0, sys_ticks: int = 0,
           lived_ticks: float = 6000.0, version: int = 3) -> bytes:
    return acct_cpu.RECORD.pack(0, version, 0, 0, 0, 0, pid, ppid, born, lived_ticks, user_ticks, sys_ticks,
                                0, 0, 0, 0, 0, 0, comm.encode())


# A controller play with one task worker, a lab (nspawn -> its init) with a vLLM server tree whose worker
# ended as 'gloo_tcp_loop', an SSH session running Ansible's python3 that started the venv's python,
# and Prometheus; then pid 101 reused by a process of another tree.
RUN = [
    (101, 100, 1000, "ansible-playboo", 30, 10),   # the task worker (exits first)
    (100, 1, 1000, "ansible-playboo", 200, 100),
    (204, 203, 1010, "gloo_tcp_loop", 900, 100),
    (203, 202, 1005, "VLLM::EngineCor", 400, 0),
    (202, 201, 1002, "python", 600, 0),
    (208, 207, 1020, "python", 800, 100),
    (207, 206, 1019, "python3", 50, 50),
    (206, 205, 1018, "sshd", 5, 5),
    (205, 201, 1000, "sshd", 1, 0),
    (209, 201, 1001, "prometheus", 70, 30),
    (201, 200, 1000, "systemd", 10, 0),
    (200, 1, 1000, "systemd-nspawn", 1, 1),
    (101, 1, 1050, "tar", 0, 40),
    # a second server: its engine ended as 'python' and its worker went to the lab's init first
    (305, 201, 1060, "gloo_tcp_loop", 300, 0),
    (304, 303, 1056, "python", 200, 0),
    (303, 201, 1055, "python", 100, 0),
]


@pytest.fixture
def pacct(tmp_path):
    path = tmp_path / "pacct"
    path.write_bytes(b"".join(record(*fields) for fields in RUN))
    return path


def test_comp_t_reads_the_exponent():
    assert acct_cpu.comp_t(1234) == 1234
    assert acct_cpu.comp_t((2 << 13) | 100) == 100 * 64


def test_each_process_lands_in_its_tree(pacct):
    processes = acct_cpu.read(pacct)
    acct_cpu.link_parents(processes)
    by_comm_born = {(p.comm, p.born): acct_cpu.category(p) for p in processes}
    assert by_comm_born[("ansible-playboo", 1000)] == "controller: ansible-playbook and its task workers"
    assert by_comm_born[("gloo_tcp_loop", 1010)] == "lab: vLLM servers (start and serve)"
    assert by_comm_born[("python", 1002)] == "lab: vLLM servers (start and serve)"  # known by its children
    assert by_comm_born[("python", 1020)].startswith("lab: over SSH, venv Python")
    assert by_comm_born[("python3", 1019)] == "lab: over SSH, Ansible's modules and sessions"
    assert by_comm_born[("prometheus", 1001)] == "lab: service prometheus"
    # pid 101 again, born after the first 101 ended: its own tree, not the play's
    assert by_comm_born[("tar", 1050)] == "controller: tar"
    assert {by_comm_born[("python", 1055)], by_comm_born[("python", 1056)], by_comm_born[("gloo_tcp_loop", 1060)]} \
        == {"lab: vLLM servers (start and serve)"}


def test_summary_sums_cpu_and_kernel_share_per_tree(pacct):
    shares = acct_cpu.by_category(_linked(pacct))
    vllm = shares["lab: vLLM servers (start and serve)"]
    assert (round(vllm.cpu_s, 2), round(vllm.sys_s, 2), vllm.processes) == (26.0, 1.0, 6)
    assert round(shares["controller: ansible-playbook and its task workers"].cpu_s, 2) == 3.4
    text = acct_cpu.summary(pacct)
    assert "16 processes, 41 CPU-s (4 of it in the kernel)" in text
    assert text.splitlines()[2].endswith("lab: vLLM servers (start and serve)")


def test_an_older_record_layout_is_refused_by_name(tmp_path):
    path = tmp_path / "pacct"
    path.write_bytes(record(1, 0, 1000, "init", version=2))
    with pytest.raises(ValueError, match="record 0 is acct version 2, not 3"):
        acct_cpu.read(path)


def _linked(path):
    processes = acct_cpu.read(path)
    acct_cpu.link_parents(processes)
    return processes
