"""A reboot in the middle of a play, over the project's transport (ansible.cfg: Mitogen).

The roles reboot only where the user allows it (`nvidia_driver` after a driver install, `kernel_cmdline`
for new flags), with `ansible.builtin.reboot`, which drops the connection and must find the host again.
Mitogen keeps one Python per host for the play, and reboots are where it has had bugs (its changelog,
issue 370; an open report, 1251), so the path is run here for real: a bare lab of its own reboots from
inside (systemd-nspawn then exits, as a machine powers off), is booted again as the power would come back,
and the same play goes on over a new connection to the new boot."""

from __future__ import annotations

import os
import time

import pytest
from conftest import LAB_NAME, Lab, boot_session_lab

from lab import nspawn

PLAY = """---
- name: Reboot mid-play and go on
  hosts: gptoss_hosts
  gather_facts: false
  tasks:
    - name: Boot ID before
      ansible.builtin.slurp:
        src: /proc/sys/kernel/random/boot_id
      register: before
    - name: Reboot
      ansible.builtin.reboot:
        reboot_timeout: 180
      register: rebooted
    - name: Boot ID after
      ansible.builtin.slurp:
        src: /proc/sys/kernel/random/boot_id
      register: after
    - name: A new boot, reached over the new connection
      ansible.builtin.assert:
        that: [rebooted.rebooted, before.content != after.content]
"""


@pytest.fixture(scope="module")
def reboot_lab() -> Lab:
    name = f"{LAB_NAME}-reboot"
    yield Lab(boot_session_lab(name, nspawn.DEFAULT_RELEASE))
    if os.environ.get("GPTOSS_KEEP_LAB") != "1":
        nspawn.down(name)


def test_a_reboot_mid_play_reaches_the_new_boot_and_the_play_goes_on(reboot_lab: Lab, tmp_path):
    playbook = tmp_path / "reboot.yml"
    playbook.write_text(PLAY)
    state = reboot_lab.state
    before = state.nspawn_pid
    proc = reboot_lab.start_play(str(playbook))
    deadline = time.monotonic() + 120
    while nspawn.is_our_nspawn(state) and proc.poll() is None:  # the reboot from inside ends nspawn
        assert time.monotonic() < deadline, "the lab never went down"
        time.sleep(0.2)
    if proc.poll() is None:
        nspawn.boot(state)  # the power comes back
    result = reboot_lab.finish_play(proc, timeout=300)
    assert result.rc == 0, result.output[-4000:]
    assert result.recap["failed"] == 0 and result.recap["ok"] == 4, result.output[-4000:]
    assert reboot_lab.state.nspawn_pid != before  # it really went down and came back
