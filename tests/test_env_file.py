"""The env_file module and the one secrets-file rule it shares with vLLM's API key file (no lab)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "collections"))

from ansible.module_utils.testing import patch_module_args  # noqa: E402
from ansible_collections.gptoss.host.plugins.module_utils import unit_inputs  # noqa: E402
from ansible_collections.gptoss.host.plugins.modules import env_file  # noqa: E402

SECRET = 'pa$$ "word" #1 %h'  # systemd and shell specials: all must arrive unchanged


def run_module(capsys, **args) -> dict:
    with patch_module_args(args), pytest.raises(SystemExit):
        env_file.main()
    return json.loads(capsys.readouterr().out)


def test_round_trip_keeps_awkward_values():
    text = unit_inputs.env_file_text({"WEBUI_ADMIN_PASSWORD": SECRET, "A_KEY": "x"})
    assert text.splitlines()[0].startswith("A_KEY=")  # sorted: the same values give the same bytes
    assert unit_inputs.parse_env_file(text) == {"WEBUI_ADMIN_PASSWORD": SECRET, "A_KEY": "x"}


@pytest.mark.parametrize(("values", "words"), [
    ({"WEBUI_ADMIN_PASSWORD": "it's"}, "single quote"),
    ({"WEBUI_ADMIN_PASSWORD": "new\nline"}, "U+000A"),
    ({"WEBUI_ADMIN_PASSWORD": ""}, "empty"),
    ({"lower_case": "x"}, "not an environment variable name"),
])
def test_refused_values_name_the_variable_never_the_value(values, words):
    with pytest.raises(ValueError) as err:
        unit_inputs.env_file_text(values)
    assert words in str(err.value)
    assert "it's" not in str(err.value) and "new\nline" not in str(err.value)


def test_module_writes_0600_then_is_idempotent_and_diff_hides_values(tmp_path: Path, capsys):
    path = tmp_path / "webui-secrets.env"
    first = run_module(capsys, path=str(path), values={"WEBUI_SECRET_KEY": SECRET}, _ansible_diff=True)
    assert first["changed"] and first["changed_names"] == ["WEBUI_SECRET_KEY"]
    assert SECRET not in json.dumps(first)
    assert path.stat().st_mode & 0o777 == 0o600
    assert unit_inputs.read_env_file(str(path)) == {"WEBUI_SECRET_KEY": SECRET}
    second = run_module(capsys, path=str(path), values={"WEBUI_SECRET_KEY": SECRET})
    assert not second["changed"]


def test_check_mode_and_refusal_leave_the_old_file(tmp_path: Path, capsys):
    path = tmp_path / "webui-secrets.env"
    path.write_text("WEBUI_SECRET_KEY='old'\n")
    path.chmod(0o600)
    checked = run_module(capsys, path=str(path), values={"WEBUI_SECRET_KEY": "new"}, _ansible_check_mode=True)
    assert checked["changed"] and path.read_text() == "WEBUI_SECRET_KEY='old'\n"
    refused = run_module(capsys, path=str(path), values={"WEBUI_SECRET_KEY": "new", "X": "it's"})
    assert refused["failed"] and "nothing written" in refused["msg"] and "X refused" in refused["msg"]
    assert path.read_text() == "WEBUI_SECRET_KEY='old'\n"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["webui-secrets.env"]  # no temporary file left
