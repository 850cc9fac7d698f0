"""module_utils/atomic_file: the one home for whole-file writes, and the callers that moved onto it
(fstab's module, vllm_change, vllm_build's cache, venv_store's manifest, model_fetch, the converter)."""

from __future__ import annotations

import os
import stat
from pathlib import Path

import pytest
from ansible_collections.gptoss.host.plugins.module_utils import atomic_file


@pytest.fixture
def fsyncs(monkeypatch) -> list[str]:
    """What was fsynced, in order: 'file:<name>' or 'dir:<name>'."""
    seen: list[str] = []
    real = os.fsync

    def spy(fd: int) -> None:
        target = os.readlink(f"/proc/self/fd/{fd}")
        kind = "dir" if stat.S_ISDIR(os.fstat(fd).st_mode) else "file"
        seen.append(f"{kind}:{os.path.basename(target)}")
        real(fd)

    monkeypatch.setattr(os, "fsync", spy)
    return seen


def test_text_and_bytes_land_whole_with_the_mode_set_before_a_byte(tmp_path, monkeypatch):
    target = tmp_path / "secret.env"
    target.write_text("old\n")
    modes = []
    real_write = os.fdopen

    def watching_fdopen(fd, *args, **kwargs):
        modes.append((stat.S_IMODE(os.fstat(fd).st_mode), os.fstat(fd).st_size))
        return real_write(fd, *args, **kwargs)

    monkeypatch.setattr(os, "fdopen", watching_fdopen)
    atomic_file.write_atomically(target, "KEY='x'\n", 0o600, owner_root=True)
    assert target.read_text() == "KEY='x'\n" and stat.S_IMODE(target.stat().st_mode) == 0o600
    assert modes == [(0o600, 0)]  # the mode was on the empty file, before the content
    assert (target.stat().st_uid, target.stat().st_gid) == (0, 0)
    atomic_file.write_atomically(target, b"\x00\xffbytes", 0o644)
    assert target.read_bytes() == b"\x00\xffbytes" and stat.S_IMODE(target.stat().st_mode) == 0o644
    assert sorted(p.name for p in tmp_path.iterdir()) == ["secret.env"]


def test_without_a_mode_a_new_file_keeps_the_temporary_files(tmp_path):
    atomic_file.write_atomically(tmp_path / "a", "x")
    assert stat.S_IMODE((tmp_path / "a").stat().st_mode) == 0o600  # mkstemp's
    old = os.umask(0o027)
    try:
        atomic_file.write_atomically(tmp_path / "b", "x", temp=tmp_path / ".b.tmp-1")
    finally:
        os.umask(old)
    assert stat.S_IMODE((tmp_path / "b").stat().st_mode) == 0o640  # 0666 less the umask, as open() would


def test_the_file_is_fsynced_before_the_rename_and_the_folder_after_when_asked(tmp_path, fsyncs, monkeypatch):
    order = []
    real_replace = os.replace
    monkeypatch.setattr(os, "replace", lambda a, b: (order.append(("replace", list(fsyncs))), real_replace(a, b)))
    atomic_file.write_atomically(tmp_path / "f.json", "{}", 0o644, sync_dir=True)
    assert order[0][1][-1].startswith("file:.f.json.")
    assert fsyncs[-1] == f"dir:{tmp_path.name}"
    fsyncs.clear()
    atomic_file.write_atomically(tmp_path / "g.json", "{}", 0o644)
    assert [f for f in fsyncs if f.startswith("dir:")] == []


def test_a_failed_check_leaves_the_old_file_and_no_temporary_file(tmp_path):
    target = tmp_path / "fstab"
    target.write_text("old\n")
    checked = []

    def refuse(tmp: str) -> None:
        checked.append(Path(tmp).read_text())
        raise SystemExit(1)  # what AnsibleModule.fail_json raises

    with pytest.raises(SystemExit):
        atomic_file.write_atomically(target, "new\n", check=refuse)
    assert checked == ["new\n"] and target.read_text() == "old\n"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["fstab"]


def test_a_named_temporary_file_is_created_exclusively_and_removed_on_failure(tmp_path):
    temp = tmp_path / ".index.json.tmp-7"
    temp.write_text("someone else's")
    with pytest.raises(FileExistsError):
        atomic_file.write_atomically(tmp_path / "index.json", "{}", temp=temp)
    assert temp.read_text() == "someone else's"  # never truncated nor removed: not ours
    with pytest.raises(ZeroDivisionError):
        atomic_file.write_atomically(tmp_path / "x", "{}", temp=tmp_path / ".x.tmp-7",
                                     check=lambda _tmp: 1 / 0)
    assert not (tmp_path / ".x.tmp-7").exists() and not (tmp_path / "x").exists()


def test_make_dirs_and_publish(tmp_path, fsyncs):
    atomic_file.write_atomically(tmp_path / "new" / "deep" / "f", "x", 0o644, make_dirs=True)
    assert (tmp_path / "new" / "deep" / "f").read_text() == "x"
    temp = tmp_path / ".shard.tmp-1"
    temp.write_bytes(b"tensor")
    fsyncs.clear()
    atomic_file.publish(temp, tmp_path / "shard")
    assert (tmp_path / "shard").read_bytes() == b"tensor" and not temp.exists()
    assert fsyncs == ["file:.shard.tmp-1", f"dir:{tmp_path.name}"]


class FakeModule:
    """What fstab.write_atomically uses of AnsibleModule: run_command (findmnt) and fail_json."""

    def __init__(self, verify_rc: int) -> None:
        self.verify_rc, self.verified = verify_rc, []

    def run_command(self, argv):
        self.verified.append(Path(argv[-1]).read_text())
        return self.verify_rc, "", "bad line" if self.verify_rc else ""

    def fail_json(self, msg):
        raise SystemExit(msg)


def test_fstab_keeps_mode_and_owner_verifies_the_temporary_file_and_syncs_the_folder(tmp_path, fsyncs):
    from ansible_collections.gptoss.host.plugins.modules import fstab

    tab = tmp_path / "fstab"
    tab.write_text("old\n")
    os.chmod(tab, 0o640)
    os.chown(tab, 0, 4)
    module = FakeModule(0)
    fstab.write_atomically(module, str(tab), "new\n")
    assert module.verified == ["new\n"] and tab.read_text() == "new\n"
    assert (stat.S_IMODE(tab.stat().st_mode), tab.stat().st_gid) == (0o640, 4)
    assert fsyncs[-1] == f"dir:{tmp_path.name}"
    with pytest.raises(SystemExit, match="fails `findmnt --verify`; fstab left untouched"):
        fstab.write_atomically(FakeModule(1), str(tab), "broken\n")
    assert tab.read_text() == "new\n" and sorted(p.name for p in tmp_path.iterdir()) == ["fstab"]


def test_the_callers_write_through_it_and_no_one_else_fsyncs_a_folder():
    """No second implementation: nothing shipped opens a folder to fsync it or renames a temporary file
    it wrote itself, except atomic_file (model_fetch's resumable download renames its .partial file)."""
    root = Path(__file__).resolve().parents[1]
    shipped = [*(root / "service").rglob("*.py"),
               *(root / "collections" / "ansible_collections" / "gptoss" / "host" / "plugins").rglob("*.py")]
    home = root / "collections/ansible_collections/gptoss/host/plugins/module_utils/atomic_file.py"
    offenders = sorted(str(p.relative_to(root)) for p in shipped
                       if p != home and ("O_DIRECTORY" in p.read_text() or "mkstemp(" in p.read_text()))
    assert offenders == []
