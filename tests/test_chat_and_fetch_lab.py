"""Issue 16 in the lab: a real chat completion through the cpu-lab profile, API-004, and the mirror
path of the model_weights role end to end (a real HTTP server on the lab's address, the real
role and module, the real files).

The resume, corruption and small-disk refusals are proven on the controller against the same module
(tests/test_model_fetch.py): a second copy of them here would cost CI minutes and prove nothing new.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import subprocess
import time
import urllib.request

import pytest
from conftest import ROOT, Lab
from mirror_server import MirrorServer

TINY_MODEL = ROOT / ".cache" / "tiny-llama-chat-bin"
MIRROR_DIR = "/models/tiny-llama-mirror"
TIKTOKEN_DIR = "/models/tiktoken-mirror"


def post_chat(lab: Lab, body: dict) -> dict:
    request = urllib.request.Request(f"{lab.base_url}/v1/chat/completions", data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json"}, method="POST")
    with urllib.request.urlopen(request, timeout=60) as response:
        return json.loads(response.read())


def test_chat_completion_through_the_cpu_lab_profile(lab: Lab):
    reply = post_chat(lab, {"model": "tiny-llama", "max_tokens": 8,
                            "messages": [{"role": "user", "content": "What is the weather in Paris?"}]})
    message = reply["choices"][0]["message"]
    assert message["role"] == "assistant" and reply["usage"]["completion_tokens"] >= 1, reply
    # The chat template is applied: the prompt holds its role markers, more tokens than the text.
    assert reply["usage"]["prompt_tokens"] > len("What is the weather in Paris?") // 4


def test_verify_api_004_passes_with_the_tool_request(lab: Lab):
    proc = lab.ssh("cd /opt/gptoss/lib && python3 -m service.host.verify --json --timeout 60", check=False)
    report = json.loads(proc.stdout)
    [api4] = [r for r in report["results"] if r["id"] == "API-004"]
    assert api4["status"] == "pass", api4
    # The random model answers the tool request with a plain message (a tool call would pass too).
    assert "; tools: " in api4["found"] and api4["found"].split("; tools: ")[1] in ("message", "tool call"), api4
    print(f"API-004: {api4['found']}")


def write_manifest(root, files: dict[str, bytes], revision: str) -> None:
    entries = []
    for name, data in files.items():
        (root / name).write_bytes(data)
        entries.append({"path": name, "size": len(data), "sha256": hashlib.sha256(data).hexdigest()})
    (root / "manifest.json").write_text(json.dumps({"revision": revision, "files": entries}))


@pytest.fixture
def lab_mirror(lab: Lab, tmp_path):
    """The tiny model and an encodings file served by manifest on the lab's own address."""
    model, tiktoken = tmp_path / "model", tmp_path / "tiktoken"
    model.mkdir()
    tiktoken.mkdir()
    files = {p.name: p.read_bytes() for p in sorted(TINY_MODEL.iterdir()) if p.is_file()}
    write_manifest(model, files, revision="tiny-chat-1")
    # A stand-in with the real file name: the real o200k_base.tiktoken is not reachable from here.
    write_manifest(tiktoken, {"o200k_base.tiktoken": os.urandom(256 * 1024)}, revision="enc-1")
    saved = lab.sh("cat /etc/gptoss/verify.d/model_weights.json")
    with MirrorServer(tmp_path, address=lab.state.address, bytes_per_s=2 * 1024 * 1024) as server:
        yield server
    lab.sh(f"rm -rf {MIRROR_DIR} {TIKTOKEN_DIR} /models/.tiny-llama-mirror.* /models/.tiktoken-mirror.*")
    lab.sh(f"cat > /etc/gptoss/verify.d/model_weights.json <<'EOF'\n{saved}EOF")


def test_role_fetches_model_and_encodings_from_a_mirror_then_changes_nothing(lab: Lab, lab_mirror):
    extra = {"model_weights_source": "mirror", "model_weights_dir": MIRROR_DIR,
             "model_weights_manifest_url": f"{lab_mirror.url}/model/manifest.json",
             "model_weights_tiktoken_manifest_url": f"{lab_mirror.url}/tiktoken/manifest.json",
             "vllm_service_tiktoken_dir": TIKTOKEN_DIR, "model_weights_progress_interval_s": 1}
    started = time.monotonic()
    first = lab.play("playbooks/model.yml", "--tags", "model_weights", extra_vars=extra)
    assert first.rc == 0, first.output[-5000:]
    assert " of " in first.output and "%)" in first.output, "no progress line on the controller"
    assert "revision tiny-chat-1 in place" in first.output
    listing = lab.sh(f"cd {MIRROR_DIR} && sha256sum config.json tokenizer.json chat_template.jinja")
    for line in listing.splitlines():
        digest, name = line.split()
        assert digest == hashlib.sha256((TINY_MODEL / name).read_bytes()).hexdigest(), name
    # The converter ran on the fetched folder; the encodings folder holds exactly the manifest's file.
    assert lab.sh(f"ls {MIRROR_DIR}/*.safetensors && ls {TIKTOKEN_DIR}").split()[-1] == "o200k_base.tiktoken"
    second = lab.play("playbooks/model.yml", "--tags", "model_weights", extra_vars=extra)
    assert second.rc == 0 and second.recap["changed"] == 0, second.output[-3000:]
    print(f"mirror fetch in the lab: first run + no-op run {time.monotonic() - started:.1f}s")


def test_copy_from_the_controller_repairs_drift_and_then_changes_nothing(lab: Lab, tmp_path):
    """The controller path of model_weights: a file edited on the host, one with the wrong mode, and
    one missing in a subfolder are copied again (and only they); the next run changes nothing."""
    source = tmp_path / "model"
    subprocess.run(["cp", "-r", str(TINY_MODEL), str(source)], check=True)
    (source / "extra" / "deep").mkdir(parents=True)
    (source / "extra" / "deep" / "notes.txt").write_text("a file in a subfolder\n")
    model = "/models/tiny-llama"
    lab.sh(f"printf ' ' >> {model}/generation_config.json && chmod 600 {model}/tokenizer_config.json")
    extra_vars = {"model_weights_source_dir": str(source)}
    try:
        result = lab.play("playbooks/model.yml", "--tags", "model_weights", extra_vars=extra_vars)
        assert result.rc == 0, result.output[-3000:]
        copied = re.findall(r"^changed: \[[^]]+\] => \(item=(\S+)\)$", result.output, re.MULTILINE)
        assert sorted(copied) == sorted([f"{model}/extra/deep", f"{model}/extra/deep/notes.txt",
                                         f"{model}/generation_config.json", f"{model}/tokenizer_config.json"])
        on_host = lab.checksums(*(f"{model}/{p.relative_to(source)}" for p in source.rglob("*") if p.is_file()))
        assert on_host == {f"{model}/{p.relative_to(source)}": hashlib.sha256(p.read_bytes()).hexdigest()
                           for p in source.rglob("*") if p.is_file()}
        modes = lab.sh(f"stat -c '%a %U %G' {model}/tokenizer_config.json {model}/extra/deep/notes.txt")
        assert modes.split() == ["644", "root", "root"] * 2
        again = lab.play("playbooks/model.yml", "--tags", "model_weights", extra_vars=extra_vars)
        assert again.rc == 0 and again.recap["changed"] == 0, again.output[-3000:]
    finally:
        lab.sh(f"rm -rf {model}/extra")
