"""The managed_files module: several root-owned files in one module run, whole or not at all (no lab)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "collections"))

from ansible.module_utils.testing import patch_module_args  # noqa: E402
from ansible_collections.gptoss.host.plugins.modules import managed_files  # noqa: E402
from conftest import VENV_BIN, run_ansible_module  # noqa: E402


def run_module(capsys, **args) -> dict:
    with patch_module_args(args), pytest.raises(SystemExit):
        managed_files.main()
    return json.loads(capsys.readouterr().out)


def test_writes_what_differs_then_changes_nothing(tmp_path: Path, capsys):
    same, other, new = tmp_path / "a-same.html", tmp_path / "b-other.lib", tmp_path / "c-new.lib"
    same.write_text("kept\n")
    same.chmod(0o640)
    other.write_text("old\n")
    other.chmod(0o600)  # a wrong mode alone is a change
    files = {str(new): "é new\n", str(other): "old\n", str(same): "kept\n"}
    before = same.stat().st_ino
    first = run_module(capsys, files=files, mode="0640", _ansible_diff=True)
    assert first["changed"] and first["changed_paths"] == [str(other), str(new)]  # sorted by path
    assert [d["after_header"] for d in first["diff"]] == [str(other), str(new)]
    assert "0o600/0/0 -> 0o640/0/0" in first["diff"][0]["before_header"]
    assert same.stat().st_ino == before  # an equal file is not rewritten
    assert other.stat().st_mode & 0o7777 == 0o640 and new.stat().st_mode & 0o7777 == 0o640
    assert new.read_text(encoding="utf-8") == "é new\n" and (new.stat().st_uid, new.stat().st_gid) == (0, 0)
    second = run_module(capsys, files=files, mode="0640")
    assert not second["changed"] and second["changed_paths"] == []


def test_check_mode_reports_and_writes_nothing(tmp_path: Path, capsys):
    page = tmp_path / "page.html"
    page.write_text("old\n")
    page.chmod(0o644)
    result = run_module(capsys, files={str(page): "new\n", str(tmp_path / "not-yet" / "x.lib"): "x"},
                        _ansible_check_mode=True, _ansible_diff=True)
    # A fresh host in check mode has no package folders yet: that is a change to report, not an error.
    assert result["changed"] and len(result["changed_paths"]) == 2
    diff = {d["after_header"]: d for d in result["diff"]}[str(page)]
    assert diff["before"] == "old\n" and diff["after"] == "new\n"
    assert page.read_text() == "old\n" and not (tmp_path / "not-yet").exists()


@pytest.mark.parametrize(("files", "mode", "words"), [
    ({"relative.html": "x"}, "0644", "is not an absolute, normalised path"),
    ({"/etc/../etc/x": "x"}, "0644", "is not an absolute, normalised path"),
    ({"/tmp/x": None}, "0644", "has no content"),
    ({"/tmp/x": "x"}, "rw-r--r--", "is not octal"),
    ({"/tmp/x": "x"}, "17777", "out of range"),
])
def test_bad_input_is_refused_and_nothing_is_written(tmp_path: Path, capsys, files, mode, words):
    first = tmp_path / "first.html"
    first.write_text("old\n")
    result = run_module(capsys, files={str(first): "new\n", **files}, mode=mode)
    assert result["failed"] and "nothing written" in result["msg"] and words in result["msg"], result
    assert first.read_text() == "old\n"


def test_a_missing_folder_fails_before_any_file_is_written(tmp_path: Path, capsys):
    first = tmp_path / "a-first.html"
    first.write_text("old\n")
    result = run_module(capsys, files={str(first): "new\n", str(tmp_path / "absent" / "x.lib"): "x"})
    assert result["failed"] and f"no folder {tmp_path / 'absent'}" in result["msg"], result
    assert first.read_text() == "old\n" and sorted(os.listdir(tmp_path)) == ["a-first.html"]


def test_through_ansible_with_check_and_diff(tmp_path: Path):
    page = tmp_path / "page.html"
    result = run_ansible_module("managed_files", {"files": {str(page): "<p>hi</p>\n"}}, "--check", "--diff")
    assert result["changed"] and not result["failed"] and "<p>hi</p>" in result["printed_diff"]
    assert not page.exists()
    written = run_ansible_module("managed_files", {"files": {str(page): "<p>hi</p>\n"}})
    assert written["changed"] and page.read_text() == "<p>hi</p>\n" and page.stat().st_mode & 0o7777 == 0o644


def test_the_monitoring_role_hands_it_every_console_file_whole(tmp_path: Path):
    """The role's variable, as ansible renders it: each file of files/consoles and files/console_libraries
    under /etc/prometheus, byte for byte (the last newline kept)."""
    role = ROOT / "roles" / "monitoring"
    playbook = tmp_path / "console-files-render.yml"
    playbook.write_text(f"""
- hosts: localhost
  gather_facts: false
  vars: {{role_path: "{role}"}}
  vars_files: ["{role}/vars/main.yml"]
  tasks:
    - ansible.builtin.copy: {{content: "{{{{ __monitoring_console_files | to_json }}}}", dest: "{playbook}.json"}}
""")
    subprocess.run([str(VENV_BIN / "ansible-playbook"), "-i", "localhost,", "-c", "local", str(playbook),
                    "-e", f"ansible_python_interpreter={sys.executable}", "-e", "monitoring_fleet_group=''"],
                   cwd=ROOT, check=True, capture_output=True, timeout=120)
    rendered = json.loads(Path(f"{playbook}.json").read_text())
    expected = {f"/etc/prometheus/{source.parent.name}/{source.name}": source.read_text()
                for folder in ("consoles", "console_libraries") for source in (role / "files" / folder).iterdir()}
    assert rendered == expected and len(expected) >= 5


def test_folder_mode_makes_the_missing_folders_with_that_mode(tmp_path: Path, capsys):
    deep = tmp_path / "code" / "service" / "host" / "verify.py"
    check = run_module(capsys, files={str(deep): "x = 1\n"}, mode="0600", folder_mode="0700", _ansible_check_mode=True)
    assert check["changed"] and not (tmp_path / "code").exists()
    result = run_module(capsys, files={str(deep): "x = 1\n", str(tmp_path / "code" / "a.py"): ""},
                        mode="0600", folder_mode="0700")
    assert result["changed"] and deep.read_text() == "x = 1\n" and (tmp_path / "code" / "a.py").read_text() == ""
    for folder in (tmp_path / "code", deep.parent.parent, deep.parent):
        assert folder.stat().st_mode & 0o7777 == 0o700, folder
    assert deep.stat().st_mode & 0o7777 == 0o600
    bad = run_module(capsys, files={str(tmp_path / "other" / "x.py"): ""}, folder_mode="07x0")
    assert bad["failed"] and "is not octal" in bad["msg"] and not (tmp_path / "other").exists()
