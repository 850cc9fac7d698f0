"""Every serving profile, as the vllm_service role renders it, equals the snapshot in tests/data.

The snapshot (tests/data/profiles_rendered.json) was taken before roles/vllm_service/vars/profiles.yml
said the shared gpt-oss flags once: what each profile serves (the merged flags, the argv they render
to, the unit's extra environment, and each instance's) must not move when the file's shape does.
The values come from ansible itself: the role's own expressions (vars/main.yml's
__vllm_service_merged_flags and __vllm_service_merged_env) over vars/profiles.yml as include_vars
loads it, then service.venv.vllm_flags.render_argv, as on the host.

    python tests/test_profiles_rendered.py > tests/data/profiles_rendered.json   # a deliberate change
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "collections"))

from service.venv.vllm_flags import render_argv  # noqa: E402

SNAPSHOT = ROOT / "tests" / "data" / "profiles_rendered.json"
ROLE = ROOT / "roles" / "vllm_service"

PLAYBOOK = """
- name: Render every profile as the role does
  hosts: localhost
  gather_facts: false
  vars_files:
    - {role}/vars/profiles.yml
    - {role}/vars/main.yml
  vars:
    vllm_service_flags_override: {{}}
    vllm_service_env_override: {{}}
    vllm_service_tiktoken_dir: ""
  tasks:
    - name: Each profile's flags, environment and instances
      ansible.builtin.set_fact:
        rendered: >-
          {{{{ rendered | default({{}}) | combine({{item: {{'flags': __vllm_service_merged_flags,
             'env': __vllm_service_merged_env,
             'instances': vllm_service_profiles[item].instances | default([])}}}}) }}}}
      loop: "{{{{ vllm_service_profiles.keys() | list }}}}"
      vars:
        vllm_service_profile: "{{{{ item }}}}"
    - name: Each instance's environment
      ansible.builtin.set_fact:
        instance_env: >-
          {{{{ instance_env | default({{}})
             | combine({{item.0.key ~ '@' ~ item.1.name: __vllm_service_merged_env}}) }}}}
      loop: "{{{{ vllm_service_profiles | dict2items | subelements('value.instances', skip_missing=True) }}}}"
      vars:
        vllm_service_profile: "{{{{ item.0.key }}}}"
        vllm_service_instance: "{{{{ item.1 }}}}"
    - name: Write them out
      ansible.builtin.copy:
        content: "{{{{ {{'profiles': rendered, 'instance_env': instance_env}} | to_json }}}}"
        dest: "{{{{ out }}}}"
        mode: "0644"
"""


def render_profiles() -> dict:
    """{profile: {flags, argv, env, instances: [{name, port, env}]}} through ansible and render_argv."""
    env = {**os.environ, "ANSIBLE_CONFIG": str(ROOT / "ansible.cfg"), "ANSIBLE_NOCOLOR": "1",
           "ANSIBLE_LOCALHOST_WARNING": "0", "ANSIBLE_INVENTORY_UNPARSED_WARNING": "0"}
    with tempfile.TemporaryDirectory() as tmp:
        playbook, out = Path(tmp) / "render.yml", Path(tmp) / "rendered.json"
        playbook.write_text(PLAYBOOK.format(role=ROLE))
        proc = subprocess.run(
            [str(ROOT / ".venv" / "bin" / "ansible-playbook"), "-i", "localhost,", "-c", "local",
             "-e", json.dumps({"out": str(out), "ansible_python_interpreter": sys.executable}), str(playbook)],
            cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
        if proc.returncode != 0:
            raise RuntimeError(proc.stdout + proc.stderr)
        raw = json.loads(out.read_text())
    result = {}
    for name, profile in raw["profiles"].items():
        result[name] = {
            "flags": profile["flags"],
            "argv": render_argv(profile["flags"]),
            "env": profile["env"],
            "instances": [{**instance, "unit_env": raw["instance_env"][f"{name}@{instance['name']}"]}
                          for instance in profile["instances"]],
        }
    return result


def test_every_profile_renders_as_in_the_snapshot() -> None:
    rendered = render_profiles()
    snapshot = json.loads(SNAPSHOT.read_text())
    assert list(rendered) == list(snapshot)
    for name in snapshot:
        # Order counts: the argv is written to vllm-args.json, and a different one restarts the server.
        assert rendered[name]["argv"] == snapshot[name]["argv"], name
        assert list(rendered[name]["flags"].items()) == list(snapshot[name]["flags"].items()), name
        assert list(rendered[name]["env"].items()) == list(snapshot[name]["env"].items()), name
        assert rendered[name]["instances"] == snapshot[name]["instances"], name


if __name__ == "__main__":
    print(json.dumps(render_profiles(), indent=1))
