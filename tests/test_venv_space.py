"""gptoss.host.venv_space through ansible on this machine: the venv space rule (venv_store.space_problem)
on a real filesystem, for a venv another task installs (the webui role's)."""

from __future__ import annotations

import os

from conftest import run_ansible_module

ARGS = {"package": "open-webui", "version": "0.12.4", "setting": "webui_venv_min_free_gib"}


def unprivileged_free_mib(path) -> int:
    """What a service user may still write there (f_bavail: root's reserved blocks left out)."""
    stat = os.statvfs(path)
    return stat.f_bavail * stat.f_frsize // (1 << 20)


def test_room_enough_passes_and_says_how_much_an_unprivileged_user_has(tmp_path):
    venv = tmp_path / "not-yet" / "webui-venv"  # measured on its nearest existing parent
    result = run_ansible_module("venv_space", {**ARGS, "path": str(venv), "min_free_mib": 1})
    assert not result["failed"] and result["changed"] is False
    assert abs(result["free_mib"] - unprivileged_free_mib(tmp_path)) < 64  # the filesystem is live
    assert not venv.parent.exists()


def test_too_little_room_fails_naming_the_path_the_need_and_the_setting_and_writes_nothing(tmp_path):
    venv = tmp_path / "webui-venv"
    for flags in ((), ("--check",)):  # check mode tells what a real run would refuse
        result = run_ansible_module("venv_space", {**ARGS, "path": str(venv), "min_free_mib": 1 << 40,
                                                   "remedy": "Free space under /opt."}, *flags)
        assert result["failed"], result
        assert result["msg"].startswith(f"{venv} has ")
        assert "the open-webui 0.12.4 venv needs 1099511627776 MiB (webui_venv_min_free_gib)" in result["msg"]
        assert result["msg"].endswith("refused before building, nothing was changed. Free space under /opt.")
    assert list(tmp_path.iterdir()) == []
