"""The verify contract: every key a role writes is read by a check (or the rollout gate), every key
read is written, and the module that writes the records refuses anything outside the contract."""

from __future__ import annotations

import ast
import hashlib
import json
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from ansible_collections.gptoss.host.plugins.module_utils import verify_contract
from ansible_collections.gptoss.host.plugins.module_utils.verify_contract import (
    CONTRACT,
    VLLM_CHANGE_ADDED_KEYS,
    ContractError,
    RoleRecord,
    check_record,
)
from conftest import ROOT, contract_record, run_ansible_module, tasks_in

MODULES = ROOT / "collections/ansible_collections/gptoss/host/plugins/modules"
READERS = [ROOT / "service/host/checks.py", MODULES / "vllm_change.py"]


# ------------------------------------------------------------------ who writes which key


def written_keys() -> dict[str, set[str]]:
    """role -> keys its tasks put in the record: verify_record calls, and vllm_change's record
    (plus the keys the module adds itself)."""
    written: dict[str, set[str]] = {}
    for path in sorted(ROOT.glob("roles/*/tasks/*.yml")):
        for task in tasks_in(yaml.safe_load(path.read_text()) or []):
            if "gptoss.host.verify_record" in task:
                args = task["gptoss.host.verify_record"]
                written.setdefault(args["role"], set()).update(args["record"])
            if "record" in (task.get("gptoss.host.vllm_change") or {}):  # a rollback restores a saved record
                written.setdefault("vllm_service", set()).update(task["gptoss.host.vllm_change"]["record"])
                written["vllm_service"].update(VLLM_CHANGE_ADDED_KEYS)
    return written


def test_every_role_writes_exactly_its_contract_keys():
    written = written_keys()
    assert set(written) == set(CONTRACT), "roles with a record vs roles in the contract"
    for role, keys in CONTRACT.items():
        assert written[role] == set(keys), f"{role}: written {sorted(written[role])}, contract {sorted(keys)}"


def test_no_role_writes_a_verify_record_any_other_way():
    for path in sorted(ROOT.glob("roles/*/tasks/*.yml")):
        for task in tasks_in(yaml.safe_load(path.read_text()) or []):
            for module in ("ansible.builtin.copy", "ansible.builtin.template", "ansible.builtin.lineinfile"):
                dest = str((task.get(module) or {}).get("dest", ""))
                assert "verify.d" not in dest, f"{path}: {task.get('name')} writes {dest} around the contract"


# ------------------------------------------------------------------ who reads which key


def _const(node: ast.AST) -> str | None:
    return node.value if isinstance(node, ast.Constant) and isinstance(node.value, str) else None


def _role_of_call(node: ast.AST) -> str | None:
    """'X' for ctx.role("X") / self.role("X")."""
    if (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "role"
            and node.args):
        return _const(node.args[0])
    return None


def read_keys() -> dict[str, set[str]]:
    """role -> keys read: `.get("k")` and `["k"]` on ctx.role("X") or on a name bound to it, and the
    rollout gate's reads of the vllm_service record (`record` in vllm_change.gate)."""
    read: dict[str, set[str]] = {}
    for path in READERS:
        tree = ast.parse(path.read_text())
        for function in (n for n in ast.walk(tree) if isinstance(n, ast.FunctionDef)):
            bound = {"record": "vllm_service"} if path.name == "vllm_change.py" and function.name == "gate" else {}
            for node in ast.walk(function):
                if isinstance(node, ast.Assign) and (role := _role_of_call(node.value)):
                    bound.update({t.id: role for t in node.targets if isinstance(t, ast.Name)})
            for node in ast.walk(function):
                target, key = None, None
                if (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "get"
                        and node.args):
                    target, key = node.func.value, _const(node.args[0])
                elif isinstance(node, ast.Subscript):
                    target, key = node.value, _const(node.slice)
                if target is None or key is None:
                    continue
                role = _role_of_call(target) or (bound.get(target.id) if isinstance(target, ast.Name) else None)
                if role:
                    read.setdefault(role, set()).add(key)
    return read


def test_every_contract_key_is_read_and_nothing_else_is():
    read = read_keys()
    for role, keys in CONTRACT.items():
        assert read.get(role, set()) == set(keys), (
            f"{role}: read {sorted(read.get(role, set()))}, contract {sorted(keys)}")
    assert set(read) <= set(CONTRACT)


def test_the_reader_finds_reads_it_should():
    """The AST reader itself: a known read of each shape is found (so the test above can fail)."""
    read = read_keys()
    assert "governor" in read["cpu_governor"]  # ctx.role("cpu_governor").get("governor")
    assert "mount_point" in read["model_mount"]  # role = ctx.role("model_mount"); role.get(...)
    assert "api_key_file" in read["vllm_service"]  # role["api_key_file"] and the gate's record.get


# ------------------------------------------------------------------ the rule itself


def test_check_record_refuses_unknown_missing_and_mistyped_keys():
    good = contract_record("vllm_service", unit="gptoss-vllm.service")
    assert check_record("vllm_service", good) == good
    with pytest.raises(ContractError, match="unknown key 'model_dir'"):
        check_record("vllm_service", {**good, "model_dir": "/models/x"})
    with pytest.raises(ContractError, match="missing key 'max_restarts'"):
        check_record("vllm_service", {k: v for k, v in good.items() if k != "max_restarts"})
    with pytest.raises(ContractError, match="'max_restarts' must be int, got bool"):
        check_record("vllm_service", {**good, "max_restarts": True})
    with pytest.raises(ContractError, match="'tool_calling' must be bool, got str"):
        check_record("vllm_service", {**good, "tool_calling": "True"})
    with pytest.raises(ContractError, match="unknown role 'webgui'"):
        check_record("webgui", {})


def test_a_check_reading_an_undeclared_key_is_refused():
    record = RoleRecord("cpu_governor", {"governor": "performance"})
    assert record.get("governor") == "performance"
    with pytest.raises(ContractError, match="key 'unit' is not in the verify contract"):
        record.get("unit")


def test_verify_refuses_a_record_outside_the_contract_with_exit_2(tmp_path: Path):
    config = tmp_path / "verify.d"
    config.mkdir()
    (config / "cpu_governor.json").write_text(json.dumps({"governor": "performance", "unit": "x.service"}))
    proc = subprocess.run([sys.executable, "-m", "service.host.verify", "--config-dir", str(config), "--json"],
                          cwd=ROOT, capture_output=True, text=True, timeout=60, check=False)
    assert proc.returncode == 2
    assert "cpu_governor.json: verify record of cpu_governor: unknown key 'unit'" in json.loads(proc.stdout)["error"]


# ------------------------------------------------------------------ the module, through ansible


def run_module(args: dict, *flags: str) -> dict:
    """The real module through ansible (localhost): what the role gets back."""
    return run_ansible_module("verify_record", args, *flags)


def digest(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest() if path.exists() else "absent"


def test_module_writes_once_keeps_check_mode_and_refuses_bad_records(tmp_path: Path):
    config = tmp_path / "verify.d"
    config.mkdir()
    target = config / "model_mount.json"
    record = {"mount_point": "/models", "fstype": "ext4", "options": ["noatime", "nobarrier"]}
    args = {"role": "model_mount", "record": record, "config_dir": str(config)}

    check = run_module(args, "--check", "--diff")
    assert check["changed"] and not target.exists()
    assert f"+++ after: {target}" in check["printed_diff"] and '+  "fstype": "ext4",' in check["printed_diff"]
    first = run_module(args)
    assert first["changed"] and json.loads(target.read_text()) == record
    assert oct(target.stat().st_mode & 0o777) == "0o644"
    assert run_module(args)["changed"] is False
    before = digest(target)

    for bad, why in (({**record, "unit": "x"}, "unknown key 'unit'"),
                     ({k: v for k, v in record.items() if k != "fstype"}, "missing key 'fstype'"),
                     ({**record, "options": "noatime"}, "'options' must be list, got str")):
        refused = run_module({**args, "record": bad})
        assert refused["failed"] and why in refused["msg"] and "left as it was" in refused["msg"]
        assert digest(target) == before
    assert sorted(p.name for p in config.iterdir()) == ["model_mount.json"]  # no temp file left


def test_render_is_stable():
    """Sorted keys: the same record is the same bytes, so a no-op converge reports changed=0."""
    a = verify_contract.render({"b": 1, "a": [2]})
    assert a == verify_contract.render({"a": [2], "b": 1}) and a.endswith("\n")
