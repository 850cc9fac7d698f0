"""module_utils/converge_receipt.py on real files here, and the module through ansible on this machine."""

from __future__ import annotations

import json
import os
from pathlib import Path

from ansible_collections.gptoss.host.plugins.module_utils import converge_receipt as cr
from conftest import run_ansible_module


def digest_of(root: Path, **kwargs) -> str:
    return cr._sha256("\n".join(cr.tree_lines(str(root), **kwargs)).encode())


def test_a_tree_changes_its_digest_with_content_mode_links_and_new_files_but_not_with_bytecode(tmp_path):
    (tmp_path / "etc").mkdir()
    conf = tmp_path / "etc" / "a.conf"
    conf.write_text("x=1\n")
    before = digest_of(tmp_path)
    (tmp_path / "etc" / "__pycache__").mkdir()
    (tmp_path / "etc" / "__pycache__" / "a.cpython-311.pyc").write_bytes(b"\0")
    assert digest_of(tmp_path) == before
    seen = {before}
    conf.write_text("x=2\n")
    seen.add(digest_of(tmp_path))
    conf.chmod(0o600)
    seen.add(digest_of(tmp_path))
    (tmp_path / "link").symlink_to("etc/a.conf")
    seen.add(digest_of(tmp_path))
    (tmp_path / "etc" / "b.conf").write_text("")
    seen.add(digest_of(tmp_path))
    assert len(seen) == 5


def test_a_big_file_is_seen_by_size_and_mtime_and_a_venv_by_what_pip_changes(tmp_path):
    weights = tmp_path / "model.safetensors"
    weights.write_bytes(b"\0" * (cr.HASHED_FILE_MAX + 1))
    line = cr.tree_lines(str(weights))[0]
    assert f"size:{cr.HASHED_FILE_MAX + 1}" in line and "sha256" not in line
    venv = tmp_path / "venv"
    site = venv / "lib" / "python3.11" / "site-packages"
    site.mkdir(parents=True)
    (venv / "pyvenv.cfg").write_text("home = /usr/bin\n")
    (site / "vllm").mkdir()
    (site / "vllm" / "big.py").write_text("# many files here are never walked\n")
    before = digest_of(venv)
    (site / "vllm" / "big.py").write_text("# edited inside a package: not seen (pip does not do this)\n")
    assert digest_of(venv) == before
    (site / "requests-2.32.0.dist-info").mkdir()  # what `pip install requests` leaves
    assert digest_of(venv) != before


def test_paths_named_by_verify_records_are_watched_and_nested_paths_collapse(tmp_path):
    records = tmp_path / "verify.d"
    records.mkdir()
    (records / "model_weights.json").write_text(json.dumps({"model_dir": "/models/gpt-oss-20b"}))
    (records / "vllm_service.json").write_text(json.dumps(
        {"inputs": ["/etc/gptoss/vllm-args.json", "/opt/gptoss/venv"], "base_url": "http://127.0.0.1:8000",
         "argv": ["--served-model-name", "gpt oss"]}))
    watched = cr.watched_paths(["/etc/gptoss", "/var/lib/gptoss"], str(records))
    assert watched == ["/etc/gptoss", "/models/gpt-oss-20b", "/opt/gptoss/venv", "/var/lib/gptoss"]


def test_the_parts_that_differ_are_named():
    state = {"files:/etc/gptoss": "a", "units": "b"}
    assert cr.differing_parts(None, "i", state) == ["no receipt (no full converge has finished here)"]
    receipt = json.loads(cr.receipt_text("i", state, [], "2026-12-04T00:00:00+00:00"))
    assert cr.differing_parts(receipt, "i", state) == []
    assert cr.differing_parts(receipt, "j", {**state, "units": "c"}) == [
        "inputs (project files, variables, inventory or controller files)", "units"]
    assert cr.differing_parts(receipt, "i", {**state, "boot": "other"}) == [
        "boot (the host rebooted since the receipt)"]
    assert cr.differing_parts(receipt, "i", state, ["h: x cannot be templated (undefined)"]) == [
        "inputs not computable ahead: h: x cannot be templated (undefined)"]


def test_a_receipt_older_than_its_maximum_age_vouches_for_nothing():
    import datetime
    state = {"units": "b"}
    receipt = json.loads(cr.receipt_text("i", state, [], "2026-12-04T00:00:00+00:00"))
    day_later = datetime.datetime(2026, 12, 5, 0, 0, 1, tzinfo=datetime.UTC)
    assert cr.differing_parts(receipt, "i", state, max_age_s=0, now=day_later) == []  # no limit
    assert cr.differing_parts(receipt, "i", state, max_age_s=86401, now=day_later) == []
    assert cr.differing_parts(receipt, "i", state, max_age_s=86400, now=day_later) == [
        "receipt age (24.0 h; gptoss_base_receipt_max_age_s: 86400)"]
    unreadable = {**receipt, "written_at": "yesterday"}
    assert cr.differing_parts(unreadable, "i", state, max_age_s=60, now=day_later)[0].startswith("receipt age (unknown")


def test_the_module_checks_writes_and_then_vouches_until_something_changes(tmp_path):
    watched = tmp_path / "etc"
    watched.mkdir()
    (watched / "a.conf").write_text("x=1\n")
    receipt = tmp_path / "var" / "receipt.json"  # a watched folder that the first write creates
    args = {"path": str(receipt), "watch": [str(watched), str(receipt.parent)],
            "records_dir": str(tmp_path / "none"), "inputs": "0" * 64}
    first = run_ansible_module("converge_receipt", {**args, "state": "check"})
    assert not first["failed"] and first["current"] is False and first["differs"][0].startswith("no receipt")
    written = run_ansible_module("converge_receipt", {**args, "state": "write", "notices": ["REBOOT REQUIRED: x"]})
    assert written["changed"] is True and oct(os.stat(receipt).st_mode & 0o777) == "0o600"
    again = run_ansible_module("converge_receipt", {**args, "state": "check"})
    assert again["current"] is True and again["notices"] == ["REBOOT REQUIRED: x"]
    (watched / "a.conf").write_text("x=2\n")
    drift = run_ansible_module("converge_receipt", {**args, "state": "check"})
    assert drift["current"] is False and drift["differs"] == [f"files:{watched}"]
    other_inputs = run_ansible_module("converge_receipt", {**args, "state": "check", "inputs": "1" * 64})
    assert other_inputs["differs"][0].startswith("inputs")
    assert run_ansible_module("converge_receipt", {**args, "state": "absent"})["changed"] is True
    assert not receipt.exists()


def test_a_record_naming_the_root_or_a_virtual_file_system_walks_nothing_there(tmp_path):
    (tmp_path / "odd.json").write_text(json.dumps({"a": "/", "b": "/proc/self", "c": "/run/x", "d": "/srv/m"}))
    assert cr.watched_paths([], str(tmp_path)) == ["/srv/m"]


def test_the_inputs_take_role_variables_and_whole_names_not_the_receipts_own_switches():
    from ansible_collections.gptoss.host.plugins.plugin_utils import receipt_inputs
    names = ["vllm_service_port", "ansible_host", "ansible_host_key_checking", "ansible_user_dir", "unrelated",
             "gptoss_base_receipt", "gptoss_base_receipt_max_age_s", "gptoss_base_prefix"]
    assert receipt_inputs.selected_names(names, ["vllm_", "gptoss_", "ansible_host"]) == [
        "ansible_host", "gptoss_base_prefix", "vllm_service_port"]
