"""conftest.kill_play_tree: a killed play leaves nothing running, not even a child in a session of its own."""

import os
import subprocess
import sys
import time

from conftest import kill_play_tree

# A parent in a session of its own (as Lab.start_play starts a play) that forks a child which leaves the
# group for a session of its own, as the processes that killed plays left behind had, and prints its pid.
PARENT = """
import subprocess, sys, time
child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"], start_new_session=True)
print(child.pid, flush=True)
time.sleep(600)
"""


def alive(pid: int) -> bool:
    """True while the process exists and is not a zombie (a zombie is dead: only its parent's wait is due)."""
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().rpartition(")")[2].split()[0] != "Z"
    except FileNotFoundError:
        return False


def test_a_child_in_a_session_of_its_own_is_killed_with_the_play():
    proc = subprocess.Popen([sys.executable, "-c", PARENT], stdout=subprocess.PIPE, text=True,
                            start_new_session=True)
    child = int(proc.stdout.readline())
    assert os.getsid(child) == child != os.getpgid(proc.pid)  # out of the group os.killpg would reach
    kill_play_tree(proc)
    deadline = time.monotonic() + 10
    while alive(child):
        assert time.monotonic() < deadline, f"the play's child {child} outlived the kill"
        time.sleep(0.05)
    assert proc.returncode == -9
