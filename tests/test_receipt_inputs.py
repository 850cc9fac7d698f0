"""The converge receipt's inputs are the values the roles will use (issue 27), proven through Ansible
itself on this machine: the real action plugin in a real ansible-playbook run, with a vault, a
lookup and extra vars. A value that changes must change the digest; one that cannot be computed
ahead must make the run a full converge, saying why. (tests/test_converge_receipt_lab.py proves the
same on the lab's live server.)"""

from __future__ import annotations

import json
import os
import shutil
import subprocess

import pytest
from ansible_collections.gptoss.host.plugins.plugin_utils import receipt_inputs
from conftest import ROOT, VENV_BIN

PLAY = """
- hosts: gpu
  gather_facts: false
  tasks:
    - name: Ask the receipt (the action plugin computes the inputs)
      gptoss.host.converge_receipt:
        state: check
        path: "{{ receipt_dir }}/receipt.json"
        watch: ["{{ receipt_dir }}/watched"]
        records_dir: "{{ receipt_dir }}/none"
        sources: ["%(roles)s"]
        var_prefixes: [gptoss_, vllm_, ansible_host]
        facts: []
        controller_files: []
      register: receipt
    - name: Show it
      ansible.builtin.debug:
        msg: "RESULT {{ {'inputs': receipt.inputs, 'differs': receipt.differs} | to_json }}"
"""


class Project:
    """An inventory folder with group_vars, as a user lays one out, and a playbook asking the receipt."""

    def __init__(self, root):
        self.root = root
        (root / "watched").mkdir()
        (root / "inventory" / "group_vars" / "gpu").mkdir(parents=True)
        (root / "inventory" / "hosts.yml").write_text(json.dumps({"gpu": {"hosts": {"box": {
            "ansible_connection": "local", "ansible_python_interpreter": str(VENV_BIN / "python"),
            "receipt_dir": str(root)}}}}))
        # A copy of the roles (their folders name the role prefixes): the project's files are an input
        # too, and must not change under the test while someone edits them.
        shutil.copytree(ROOT / "roles", root / "roles")
        (root / "play.yml").write_text(PLAY % {"roles": root / "roles"})
        (root / "vault-pass").write_text("test-vault-password\n")

    def group_vars(self, name: str, values: dict) -> None:
        (self.root / "inventory" / "group_vars" / "gpu" / name).write_text(json.dumps(values))

    def encrypt(self, name: str) -> None:
        subprocess.run([str(VENV_BIN / "ansible-vault"), "encrypt", "--vault-password-file",
                        str(self.root / "vault-pass"), str(self.root / "inventory" / "group_vars" / "gpu" / name)],
                       check=True, capture_output=True, cwd=ROOT, env=self.env)

    @property
    def env(self) -> dict[str, str]:
        return {**os.environ, "ANSIBLE_CONFIG": str(ROOT / "ansible.cfg"), "ANSIBLE_NOCOLOR": "1",
                "ANSIBLE_STDOUT_CALLBACK": "ansible.builtin.default", "ANSIBLE_CALLBACK_RESULT_FORMAT": "json"}

    def inputs(self, *args: str) -> dict:
        proc = subprocess.run([str(VENV_BIN / "ansible-playbook"), "-i", str(self.root / "inventory" / "hosts.yml"),
                               "--vault-password-file", str(self.root / "vault-pass"), str(self.root / "play.yml"),
                               *args], cwd=ROOT, env=self.env, capture_output=True, text=True, timeout=300)
        assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
        line = next(line for line in proc.stdout.splitlines() if "RESULT " in line)
        message = json.loads('"' + line.split('"msg": "', 1)[1].rsplit('"', 1)[0] + '"')
        return json.loads(message.removeprefix("RESULT "))


@pytest.fixture
def project(tmp_path) -> Project:
    return Project(tmp_path)


def test_a_key_rotated_in_a_plain_or_encrypted_vault_file_changes_the_inputs(project: Project):
    project.group_vars("main.yml", {"vllm_service_api_key": "{{ vault_gptoss_api_key }}"})
    project.group_vars("vault.yml", {"vault_gptoss_api_key": "first-key-0123456789"})
    first = project.inputs()
    assert project.inputs()["inputs"] == first["inputs"]  # same values: same digest
    project.group_vars("vault.yml", {"vault_gptoss_api_key": "second-key-0123456789"})
    second = project.inputs()
    assert second["inputs"] != first["inputs"]
    project.encrypt("vault.yml")
    encrypted = project.inputs()
    assert encrypted["inputs"] != second["inputs"]  # the vault file's bytes are an input
    project.group_vars("vault.yml", {"vault_gptoss_api_key": "third-key-0123456789"})
    project.encrypt("vault.yml")
    assert project.inputs()["inputs"] not in {first["inputs"], second["inputs"], encrypted["inputs"]}


def test_the_value_of_a_vault_variable_is_an_input_not_only_the_files_text(project: Project, tmp_path):
    """The same inventory files, the key from a file outside them: only the templated value changes."""
    key_file = tmp_path / "key"
    key_file.write_text("from-a-file-0123456789")
    from_file = "{{ lookup('ansible.builtin.file', '" + str(key_file) + "') }}"
    project.group_vars("main.yml", {"vllm_service_api_key": from_file})
    first = project.inputs()
    assert first["differs"] and not any("not computable" in d for d in first["differs"])
    key_file.write_text("rotated-in-the-file-0123456789")
    assert project.inputs()["inputs"] != first["inputs"]


def test_an_unprefixed_extra_var_that_a_role_variable_templates_is_an_input(project: Project):
    project.group_vars("main.yml", {"vllm_service_api_key": "{{ my_key }}"})
    first = project.inputs("-e", "my_key=extra-var-key-0123456789")
    assert project.inputs("-e", "my_key=extra-var-key-0123456789")["inputs"] == first["inputs"]
    assert project.inputs("-e", "my_key=another-key-0123456789")["inputs"] != first["inputs"]


def test_a_lookup_with_side_effects_or_an_undefined_value_makes_a_full_converge_and_says_why(project: Project):
    project.group_vars("main.yml", {"vllm_service_api_key": "{{ lookup('ansible.builtin.pipe', 'echo k') }}"})
    piped = project.inputs()
    assert piped["inputs"].startswith("unverifiable:")
    assert any("vllm_service_api_key: lookup 'pipe'" in d and d.startswith("inputs not computable ahead")
               for d in piped["differs"]), piped["differs"]
    project.group_vars("main.yml", {"vllm_service_api_key": "{{ nowhere_defined }}"})
    undefined = project.inputs()
    assert any("vllm_service_api_key cannot be templated" in d and "nowhere_defined" in d
               for d in undefined["differs"]), undefined["differs"]
    assert undefined["inputs"] != project.inputs()["inputs"]  # never the same twice: never "holds"


def test_no_secret_reaches_the_digest_input_text_in_clear():
    """The module gets a digest; the plugin's problems name variables and lookups, never values."""
    assert receipt_inputs.unsafe_lookups({"vault_key": "{{ lookup('pipe', 'pass show secret-name') }}"}) == [
        "vault_key: lookup 'pipe'"]
    assert receipt_inputs.unsafe_lookups({"k": "{{ lookup('file', '/x') ~ query('env', 'HOME') | first }}",
                                          "hostvars": "{{ lookup('pipe', 'x') }}"}) == []
    assert receipt_inputs.unsafe_lookups({"k": "{{ lookup(name, 'x') }}"}) == ["k: lookup '(computed)'"]
