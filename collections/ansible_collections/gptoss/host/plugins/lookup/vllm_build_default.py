"""Lookup gptoss.host.vllm_build_default: the default of a vLLM build input, from its one home.

The vLLM build's inputs (package, version, install source, index URLs, wheelhouse, system python,
venv, enabled) are read by two roles: vllm_service builds the venv, nvidia_driver derives the driver
that build needs. Their defaults live once, in the collection's vars/vllm_build.yml; each role reads
them through this lookup (vllm_service in its defaults, nvidia_driver as the fallback where the
inventory does not set them), so neither role loads the other's files.
"""

from __future__ import annotations

import os

import yaml
from ansible.errors import AnsibleLookupError
from ansible.plugins.lookup import LookupBase

DOCUMENTATION = r"""
name: vllm_build_default
short_description: The default of a vLLM build input (vllm_service_*), from the collection's vars/vllm_build.yml
description:
  - Returns the default value of each named variable, as vars/vllm_build.yml holds it.
  - An unknown name is an error (a typo would otherwise read as empty).
options:
  _terms: {description: Variable names, e.g. vllm_service_version., required: true}
"""

HOME = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))),
                    "vars", "vllm_build.yml")


def defaults() -> dict:
    with open(HOME, encoding="utf-8") as handle:
        return yaml.safe_load(handle) or {}


class LookupModule(LookupBase):
    def run(self, terms, variables=None, **kwargs):
        known = defaults()
        missing = [t for t in terms if t not in known]
        if missing:
            raise AnsibleLookupError(f"vllm_build_default: {', '.join(missing)} not in {HOME} "
                                     f"(known: {', '.join(sorted(known))})")
        return [known[t] for t in terms]
