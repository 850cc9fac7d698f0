"""Every module of the collection documents itself the way `ansible-doc` reads it.

A description line holding ": " is a YAML mapping, not text: managed_files' DOCUMENTATION had two, so
`ansible-doc gptoss.host.managed_files` failed ("Unable to parse documentation") while ansible-lint and
every converge stayed green. Ansible's own reader decides here, not a YAML load of ours."""

from __future__ import annotations

import json
import subprocess

from conftest import ROOT, VENV_BIN

MODULES_DIR = ROOT / "collections" / "ansible_collections" / "gptoss" / "host" / "plugins" / "modules"
MODULES = sorted(path.stem for path in MODULES_DIR.glob("*.py") if path.stem != "__init__")


def test_ansible_doc_reads_every_module_with_its_examples_and_return_values():
    names = [f"gptoss.host.{name}" for name in MODULES]
    proc = subprocess.run([str(VENV_BIN / "ansible-doc"), "-t", "module", "--json", *names], cwd=ROOT,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    docs = json.loads(proc.stdout)
    assert sorted(docs) == names
    for name, entry in docs.items():
        assert entry["doc"]["short_description"], name
        assert entry["doc"]["description"], name
        assert entry["examples"].strip(), name
        assert entry["return"], name
