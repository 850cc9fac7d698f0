"""gptoss.host.model_fetch: the mirror path against a real HTTP server, real files, a real small disk.

The module runs as Ansible runs it (a python process reading ANSIBLE_MODULE_ARGS), so check mode,
the refusals and the JSON result are the module's own. The hf path runs against olah, a real hub
mirror (tests/olah_server.py; the lab's end-to-end runs are tests/test_hub_mirror_lab.py); ModelScope
cannot be reached from here: only its argument checks are tested.
"""

from __future__ import annotations

import hashlib
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from mirror_server import MirrorServer
from olah_server import HubRepo, Olah, OlahProxy, install_olah

REPO = Path(__file__).resolve().parents[1]
COLLECTIONS = REPO / "collections"
MODULE = COLLECTIONS / "ansible_collections" / "gptoss" / "host" / "plugins" / "modules" / "model_fetch.py"
sys.path.insert(0, str(COLLECTIONS))

from ansible_collections.gptoss.host.plugins.module_utils import model_fetch as mf  # noqa: E402

BIG = 3 * 1024 * 1024  # big enough to kill mid-file at 256 KiB/s


def write_mirror(root: Path, files: dict[str, bytes], revision: str = "r1") -> Path:
    entries = []
    for name, data in files.items():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_bytes(data)
        entries.append({"path": name, "size": len(data), "sha256": hashlib.sha256(data).hexdigest()})
    manifest = root / "manifest.json"
    manifest.write_text(json.dumps({"revision": revision, "files": entries}))
    return manifest


@pytest.fixture
def mirror(tmp_path):
    root = tmp_path / "mirror"
    root.mkdir()
    files = {"config.json": b'{"model_type": "llama"}\n', "model.safetensors": os.urandom(BIG),
             "sub/tokenizer.json": b"{}\n"}
    write_mirror(root, files)
    with MirrorServer(root) as server:
        yield server, files


def module_args_file(tmp_path: Path, args: dict, check: bool) -> Path:
    path = tmp_path / f"args-{time.monotonic_ns()}.json"
    path.write_text(json.dumps({"ANSIBLE_MODULE_ARGS": {**args, "_ansible_check_mode": check}}))
    return path


def start_module(tmp_path: Path, args: dict, check: bool = False) -> subprocess.Popen:
    env = {**os.environ, "PYTHONPATH": str(COLLECTIONS)}
    return subprocess.Popen([sys.executable, str(MODULE), str(module_args_file(tmp_path, args, check))],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)


def run_module(tmp_path: Path, args: dict, check: bool = False) -> dict:
    proc = start_module(tmp_path, args, check)
    out, err = proc.communicate(timeout=120)
    assert out, err
    return json.loads(out)


def tree(folder: Path) -> dict[str, str]:
    return {str(p.relative_to(folder)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(folder.rglob("*")) if p.is_file()}


def test_fetch_switches_in_verified_files_and_a_second_run_changes_nothing(tmp_path, mirror):
    server, files = mirror
    dest = tmp_path / "models" / "tiny"
    args = {"dest": str(dest), "source": "mirror", "manifest_url": f"{server.url}/manifest.json"}
    planned = run_module(tmp_path, args, check=True)
    assert planned["changed"] and planned["bytes_missing"] == sum(map(len, files.values()))
    assert not dest.exists(), "check mode wrote the target"
    first = run_module(tmp_path, args)
    assert first["changed"] and first["done"] and first["revision"] == "r1", first
    assert {k: v for k, v in tree(dest).items() if k != mf.MARKER} == {
        name: hashlib.sha256(data).hexdigest() for name, data in files.items()}
    assert not list(dest.parent.glob(".tiny.staging-*")), "staging folder left behind"
    second = run_module(tmp_path, args)
    assert second["changed"] is False and second["progress"].endswith("already in place")


def test_a_download_killed_mid_file_resumes_with_a_range_request(tmp_path, mirror):
    server, files = mirror
    server.bytes_per_s = 256 * 1024
    dest = tmp_path / "models" / "tiny"
    args = {"dest": str(dest), "source": "mirror", "manifest_url": f"{server.url}/manifest.json"}
    proc = start_module(tmp_path, args)
    partial = None
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        found = list(dest.parent.glob(".tiny.staging-*/model.safetensors.partial"))
        if found and found[0].stat().st_size > 256 * 1024:
            partial = found[0]
            break
        time.sleep(0.1)
    assert partial is not None, "the download never started"
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    kept = partial.stat().st_size
    assert 0 < kept < BIG and not dest.exists()
    server.bytes_per_s = 0
    resumed = run_module(tmp_path, args)
    assert resumed["done"] and resumed["bytes_missing"] <= BIG - kept + 1024, resumed
    ranges = [rng for path, rng in server.requests if path == "/model.safetensors"]
    assert ranges[0] == "" and ranges[-1].startswith("bytes=") and int(ranges[-1][6:-1]) >= kept, ranges
    assert tree(dest)["model.safetensors"] == hashlib.sha256(files["model.safetensors"]).hexdigest()


def test_one_corrupted_byte_is_refused_and_the_live_folder_is_untouched(tmp_path, mirror):
    server, files = mirror
    dest = tmp_path / "models" / "tiny"
    args = {"dest": str(dest), "source": "mirror", "manifest_url": f"{server.url}/manifest.json"}
    assert run_module(tmp_path, args)["changed"]
    live_before = tree(dest)
    # Revision r2 on the mirror; its weights get one byte flipped after the manifest was written.
    changed = {**files, "model.safetensors": os.urandom(BIG)}
    write_mirror(server.root, changed, revision="r2")
    blob = bytearray((server.root / "model.safetensors").read_bytes())
    blob[BIG // 2] ^= 0x01
    (server.root / "model.safetensors").write_bytes(bytes(blob))
    refused = run_module(tmp_path, args)
    assert refused.get("failed") and "model.safetensors: sha256" in refused["msg"], refused
    assert "refused" in refused["msg"]
    assert tree(dest) == live_before
    assert not list(dest.parent.glob(".tiny.staging-*/model.safetensors*")), "the bad bytes were kept"
    # The mirror repaired: r2 replaces r1 in one rename exchange, the old folder is gone.
    (server.root / "model.safetensors").write_bytes(changed["model.safetensors"])
    switched = run_module(tmp_path, args)
    assert switched["changed"] and switched["revision"] == "r2"
    assert tree(dest)["model.safetensors"] == hashlib.sha256(changed["model.safetensors"]).hexdigest()
    assert sorted(p.name for p in dest.parent.iterdir()) == ["tiny"]


@pytest.fixture
def small_disk(tmp_path):
    mount_point = tmp_path / "small"
    mount_point.mkdir()
    if subprocess.run(["mount", "-t", "tmpfs", "-o", "size=2m", "tmpfs", str(mount_point)]).returncode != 0:
        pytest.skip("cannot mount a tmpfs here (needs root)")
    yield mount_point
    subprocess.run(["umount", str(mount_point)], check=True)


def test_a_disk_too_small_is_refused_before_the_download_starts(tmp_path, mirror, small_disk):
    server, _ = mirror
    dest = small_disk / "tiny"
    args = {"dest": str(dest), "source": "mirror", "manifest_url": f"{server.url}/manifest.json"}
    for check in (True, False):
        refused = run_module(tmp_path, args, check=check)
        assert refused.get("failed") and "only" in refused["msg"] and "nothing was downloaded" in refused["msg"]
    assert [path for path, _ in server.requests] == ["/manifest.json", "/manifest.json"]
    assert list(small_disk.iterdir()) == [], "something was written before the refusal"


def test_time_budget_returns_progress_and_the_next_call_goes_on(tmp_path, mirror):
    server, files = mirror
    server.bytes_per_s = 1024 * 1024
    dest = tmp_path / "models" / "tiny"
    args = {"dest": str(dest), "source": "mirror", "manifest_url": f"{server.url}/manifest.json", "time_budget_s": 1}
    first = run_module(tmp_path, args)
    assert first["done"] is False and " of " in first["progress"] and "%" in first["progress"], first
    assert not dest.exists()
    server.bytes_per_s = 0
    assert run_module(tmp_path, {**args, "time_budget_s": 0})["done"] is True


@pytest.mark.parametrize(
    ("manifest", "message"),
    [
        ({"files": [{"path": "a", "size": 1, "sha256": "0" * 64}]}, "no revision"),
        ({"revision": "r", "files": [{"path": "../etc/passwd", "size": 1, "sha256": "0" * 64}]}, "relative path"),
        ({"revision": "r", "files": [{"path": "/etc/passwd", "size": 1, "sha256": "0" * 64}]}, "relative path"),
        ({"revision": "r", "files": [{"path": "a", "size": 1, "sha256": "abc"}]}, "64 hex digits"),
        ({"revision": "r", "files": [{"path": "a", "size": 1}]}, "needs path, size and sha256"),
        ({"revision": "r", "files": []}, "expected"),
    ],
)
def test_bad_manifests_are_refused_with_the_reason(manifest, message):
    with pytest.raises(mf.FetchError, match=message):
        mf.parse_manifest(manifest)


def test_hub_sources_need_a_pinned_commit_and_say_when_the_client_is_missing(tmp_path):
    moving = run_module(tmp_path, {"dest": str(tmp_path / "m"), "source": "hf", "repo_id": "openai/gpt-oss-20b",
                                   "revision": "main"})
    assert moving["failed"] and "pin a full 40-hex commit id" in moving["msg"]
    pinned = {"dest": str(tmp_path / "m"), "repo_id": "openai/gpt-oss-20b", "revision": "a" * 40}
    for source, package in (("hf", "huggingface_hub"), ("modelscope", "modelscope")):
        try:
            __import__(package)
        except ImportError:
            result = run_module(tmp_path, {**pinned, "source": source})
            assert result["failed"] and "client library is not importable" in result["msg"], result
    assert not (tmp_path / "m").exists()


def test_git_blob_id_matches_git(tmp_path):
    sample = tmp_path / "config.json"
    sample.write_bytes(b'{"a": 1}\n')
    expected = subprocess.run(["git", "hash-object", str(sample)], capture_output=True, text=True, check=True)
    assert mf.git_blob_sha1(sample) == expected.stdout.strip()


def test_hf_source_against_a_real_hub_mirror(tmp_path):
    """olah serving a git repository: the file list by the tree API (sizes, blob ids, LFS sha256),
    every file checked, a no-op second run, and a commit the mirror lacks refused with its answer."""
    repo = HubRepo(tmp_path / "mirrors", "gptoss-test/tiny")
    files = {"config.json": b'{"model_type": "llama"}\n', "model.safetensors": os.urandom(300 * 1024),
             "sub/tokenizer.json": b"{}\n"}
    commit = repo.commit(files, "first")
    with Olah(install_olah(), tmp_path / "mirrors", tmp_path / "olah") as olah:
        dest = tmp_path / "models" / "tiny"
        args = {"dest": str(dest), "source": "hf", "repo_id": repo.repo_id, "revision": commit,
                "endpoint": olah.url}
        planned = run_module(tmp_path, args, check=True)
        assert planned["bytes_missing"] == sum(map(len, files.values())), planned
        first = run_module(tmp_path, args)
        assert first["changed"] and first["revision"] == commit, first
        assert {k: v for k, v in tree(dest).items() if k != mf.MARKER} == {
            name: hashlib.sha256(data).hexdigest() for name, data in files.items()}  # no .gitattributes, no .cache
        assert run_module(tmp_path, args)["changed"] is False
        missing = run_module(tmp_path, {**args, "revision": "0" * 40})
        assert missing["failed"] and olah.url in missing["msg"] and "404" in missing["msg"], missing
        assert "Entry Not Found" in missing["msg"] and "unchanged" in missing["msg"]
        assert tree(dest)["model.safetensors"] == hashlib.sha256(files["model.safetensors"]).hexdigest()


def test_hf_download_resumes_a_partial_file_with_range_and_restarts_where_range_is_ignored(tmp_path):
    """A killed run leaves `<name>.partial`; the next run asks for the rest. An olah proxy (in front
    of the git mirror) answers 206 and only the rest; the git mirror itself answers 200 and the whole
    file, which the client writes from byte 0 again. Both end verified; a partial with wrong bytes
    is refused by its sha256 and deleted."""
    size, kept = 8 << 20, 3 << 20
    data = os.urandom(size)
    repo = HubRepo(tmp_path / "mirrors", "gptoss-test/tiny")
    commit = repo.commit({"model.safetensors": data}, "first")
    spec = mf.FileSpec("model.safetensors", size, hashlib.sha256(data).hexdigest())
    venv = install_olah()
    with Olah(venv, tmp_path / "mirrors", tmp_path / "olah") as mirror:
        mirror.serve_repo_info(repo.repo_id, commit)
        with OlahProxy(venv, mirror, tmp_path / "proxy", block_size=16 << 20) as proxy:
            for server, status in ((proxy, "206"), (mirror, "200")):
                staging = tmp_path / f"staging-{status}"
                staging.mkdir()
                (staging / "model.safetensors.partial").write_bytes(data[:kept])
                since = len(server.requests())
                mf.hf_download(repo.repo_id, commit, spec, staging, server.url, None)
                gets = [r for r in server.requests()[since:] if r.startswith("GET ")]
                assert gets == [f"GET /{repo.repo_id}/resolve/{commit}/model.safetensors {status}"], gets
                assert tree(staging) == {"model.safetensors": spec.sha256}
            bad = tmp_path / "staging-bad"
            bad.mkdir()
            (bad / "model.safetensors.partial").write_bytes(bytes(kept))
            with pytest.raises(mf.FetchError, match="sha256 .* does not match"):
                mf.hf_download(repo.repo_id, commit, spec, bad, proxy.url, None)
            assert tree(bad) == {}
