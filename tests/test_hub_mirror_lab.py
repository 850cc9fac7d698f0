"""Issue 26: model_weights_source hf against a real hub mirror (olah, offline, serving a git repository;
for the resume, a second olah in front of it as a caching proxy; for the token, a third in front of an
upstream that wants one).

olah runs on the controller (its own venv, `invoke lab.olah`) on the lab's address and serves the tiny
model as a hub repository (tests/olah_server.py): safetensors as LFS, config and tokenizer files as git
blobs. The role runs for real on the lab: the official client in the fetch venv, the staging folder,
the per-file sha256 / blob id check, the switch. Only the model_weights tag is converged, except in
the first test, which also moves vLLM onto the downloaded folder to show it serving.
"""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import threading
import time
import urllib.request

import pytest
from conftest import ROOT, VENV_BIN, Lab, kill_play_tree, record_timing
from olah_server import HubRepo, Olah, OlahProxy, TokenGate, copy_model, git, install_olah

TINY_MODEL = ROOT / ".cache" / "tiny-llama-chat-bin"
REPO_ID = "gptoss-test/tiny-llama"
HUB_DIR = "/models/tiny-llama-hub"
BIG = 128 << 20  # about 7 s through olah on this machine: long enough to be caught mid-file


@pytest.fixture(scope="module")
def hub(lab: Lab, tmp_path_factory):
    """olah serving REPO_ID: commit `small` (the tiny model as safetensors) and `big` (plus one large
    LFS file) on main, and a second olah in front of it as a caching proxy (the one that answers
    Range: tests/olah_server.py OlahProxy, its block as large as the largest file); the lab's hub
    folder is removed afterwards."""
    olah_venv = install_olah()
    work = tmp_path_factory.mktemp("hub")
    model = work / "model"
    subprocess.run(["cp", "-r", str(TINY_MODEL), str(model)], check=True)
    # The hub ships safetensors: converted here by the project's own converter (its one home).
    subprocess.run([str(VENV_BIN / "python"), "-m", "service.venv.convert", str(model), "--delete-originals",
                    "--no-progress"], cwd=ROOT, check=True, capture_output=True)
    repo = HubRepo(work / "mirrors", REPO_ID)
    files = copy_model(model)
    small = repo.commit(files, "tiny llama as safetensors")
    big = repo.commit({"assets/blob.dat": os.urandom(BIG)}, "a large LFS file")
    olah = Olah(olah_venv, work / "mirrors", work / "olah", address=lab.state.address).start()
    olah.serve_repo_info(REPO_ID, big)
    proxy = OlahProxy(olah_venv, olah, work / "proxy", block_size=2 * BIG, address=lab.state.address).start()
    yield {"olah": olah, "proxy": proxy, "repo": repo, "files": files, "small": small, "big": big,
           "venv": olah_venv, "work": work}
    proxy.stop()
    olah.stop()
    lab.sh(f"rm -rf {HUB_DIR} /models/.tiny-llama-hub.*")


def hf_vars(hub: dict, revision: str, **more) -> dict:
    return {"model_weights_source": "hf", "model_weights_dir": HUB_DIR, "model_weights_repo_id": REPO_ID,
            "model_weights_revision": revision, "model_weights_hf_endpoint": hub["olah"].url,
            "model_weights_progress_interval_s": 1, **more}


def said(result, text: str) -> bool:
    """`text` in the play's output, whatever the callback's line wrapping of a long message."""
    return text in " ".join(result.output.split())


def model_play(lab: Lab, extra: dict, timeout: float = 900):
    return lab.play("playbooks/model.yml", "--tags", "model_weights", extra_vars=extra, timeout=timeout)


def start_model_play(lab: Lab, extra: dict) -> subprocess.Popen:
    return subprocess.Popen([str(VENV_BIN / "ansible-playbook"), "playbooks/model.yml", "--tags", "model_weights",
                             "-e", json.dumps(extra)], cwd=ROOT, env=lab.env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, start_new_session=True)


def wait_for_request(olah: Olah, needle: str, since: int, timeout: float = 300) -> None:
    """Until olah's log has a request containing `needle` after its first `since` requests."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if any(needle in line for line in olah.requests()[since:]):
            return
        time.sleep(0.1)
    raise AssertionError(f"olah never got {needle!r}: {olah.requests()[-10:]}")


def kill_play(lab: Lab, proc: subprocess.Popen) -> None:
    """The play killed as an operator's Ctrl-C twice would: the controller's ansible-playbook, then the
    module it started on the lab (by its pid) if it outlived the play. Under Mitogen (ansible.cfg) the
    fetch venv's python on the host exits when its connection goes; under the stock strategy the
    module would finish on its own. Either way nothing of the killed play may still be writing."""
    kill_play_tree(proc)
    running = "pgrep -f '/opt/gptoss/fetch-[v]env/bin/python' || true"
    pids = lab.ssh(running).stdout.split()
    if pids:
        lab.ssh(f"kill -9 {' '.join(pids)}", check=False)
    deadline = time.monotonic() + 10
    while lab.ssh(running).stdout.split():
        assert time.monotonic() < deadline, "the killed play's module is still running on the lab"
        time.sleep(0.5)


def hub_tree(lab: Lab) -> dict[str, str]:
    out = lab.sh(f"cd {HUB_DIR} 2>/dev/null && find . -type f ! -name '.gptoss-fetch.json' -exec sha256sum {{}} +"
                 " || true")
    return {line.split()[1][2:]: line.split()[0] for line in out.splitlines() if line.strip()}


def partial_bytes(lab: Lab) -> int:
    """The bytes a killed run left in the staging folder (`<name>.partial`)."""
    out = lab.sh("find /models/.tiny-llama-hub.staging-* -name '*.partial' -printf '%s\\n' 2>/dev/null || true")
    return sum(int(n) for n in out.split())


def bytes_answered(url: str, start: int) -> tuple[int, int]:
    """(status, bytes of the body) of `GET url` with `Range: bytes=<start>-`, read to the end."""
    request = urllib.request.Request(url, headers={"Range": f"bytes={start}-"})
    with urllib.request.urlopen(request, timeout=300) as answer:  # noqa: S310
        size = 0
        while block := answer.read(1 << 20):
            size += len(block)
        return answer.status, size


def test_hf_source_downloads_serves_verifies_then_changes_nothing(lab: Lab, hub):
    """Must-show 1: the endpoint and the commit as revision; vLLM moved onto the downloaded folder,
    verify (MDL-001 and the API checks) passes, the next run changes nothing."""
    olah = hub["olah"]
    extra = hf_vars(hub, hub["small"], vllm_service_model_dir=HUB_DIR)
    first_request = len(olah.requests())
    try:
        started = time.monotonic()
        first = lab.play("site.yml", "--tags", "model_weights,vllm_service", extra_vars=extra)
        assert first.rc == 0, first.output[-6000:]
        record_timing("hub_mirror_first_converge", time.monotonic() - started)
        assert said(first, f"revision {hub['small']} in place"), first.output[-3000:]
        print("olah requests of one full download:\n  " + "\n  ".join(olah.requests()[first_request:]))
        expected = {name: hashlib.sha256(data).hexdigest() for name, data in hub["files"].items()}
        assert hub_tree(lab) == expected
        report = json.loads(lab.ssh("cd /opt/gptoss/lib && python3 -m service.host.verify --json --timeout 120",
                                    check=False).stdout)
        by_id = {r["id"]: r for r in report["results"]}
        assert by_id["MDL-001"]["status"] == "pass" and HUB_DIR in json.dumps(by_id["MDL-001"]), by_id["MDL-001"]
        # The lab's waived checks (inventory/lab-waivers.json: what a container cannot show) aside.
        waived = {w["id"] for w in json.loads((ROOT / "inventory" / "lab-waivers.json").read_text())}
        failed = [r for r in report["results"] if r["status"] == "fail" and r["id"] not in waived]
        assert not failed, [f"{r['id']}: {r['reason']}" for r in failed]
        served = lab.sh("systemctl show -p ExecStart --value gptoss-vllm.service")
        assert HUB_DIR in served, served
        second = lab.play("site.yml", "--tags", "model_weights,vllm_service", extra_vars=extra)
        assert second.rc == 0 and second.recap["changed"] == 0, second.output[-3000:]
    finally:
        back = lab.play("site.yml", "--tags", "vllm_service")
        assert back.rc == 0, back.output[-3000:]


def test_a_play_killed_mid_file_resumes_on_the_next_run(lab: Lab, hub):
    """Must-show 2, through the olah proxy (the git mirror itself answers Range with 200 and the
    whole file): the play killed mid-file, the re-run asks for the rest (Range from the partial
    file's length), the proxy answers 206, the file ends verified."""
    proxy = hub["proxy"]
    extra = hf_vars(hub, hub["big"], model_weights_hf_endpoint=proxy.url)
    resolve = f"/{REPO_ID}/resolve/{hub['big']}/assets/blob.dat"
    lab.sh("rm -rf /models/.tiny-llama-hub.staging-*")  # no partial file from an earlier run
    since = len(proxy.requests())
    proc = start_model_play(lab, extra)
    wait_for_request(proxy, "GET " + resolve, since)
    time.sleep(2.5)
    kill_play(lab, proc)
    kept = partial_bytes(lab)
    assert 0 < kept < BIG, f"not caught mid-file: {kept} bytes of {BIG}"
    assert lab.sh(f"test -e {HUB_DIR}/assets/blob.dat && echo yes || echo no").strip() == "no"
    before, upstream_before = len(proxy.requests()), len(proxy.upstream_requests())
    started = time.monotonic()
    again = model_play(lab, extra)
    assert again.rc == 0, again.output[-4000:]
    record_timing("hub_mirror_rerun_after_kill", time.monotonic() - started)
    gets = [r for r in proxy.requests()[before:] if r.startswith("GET " + resolve + " ")]
    assert gets == [f"GET {resolve} 206"], proxy.requests()[before:]
    assert lab.sh(f"sha256sum {HUB_DIR}/assets/blob.dat").split()[0] == hub["repo"].lfs_sha256("assets/blob.dat")
    # What the proxy sends for that request (Range from the partial file's length), read here.
    status, sent = bytes_answered(proxy.url + resolve, kept)
    assert status == 206 and sent == BIG - kept, (status, sent)
    print(f"killed with {kept} of {BIG} bytes in the partial file; the re-run's GET was answered 206 with "
          f"the rest, {sent} bytes; the run took {again.seconds:.1f}s; the proxy asked the mirror: "
          + ", ".join(proxy.upstream_requests()[upstream_before:]))


def test_a_revision_the_mirror_does_not_have_is_refused_and_the_live_folder_stays(lab: Lab, hub):
    """Must-show 3."""
    if not hub_tree(lab):  # run alone: a live folder to keep first
        assert model_play(lab, hf_vars(hub, hub["small"])).rc == 0
    before = hub_tree(lab)
    missing = "0" * 40
    refused = model_play(lab, hf_vars(hub, missing))
    assert refused.rc != 0
    assert said(refused, hub["olah"].url) and said(refused, "404"), refused.output[-3000:]
    assert said(refused, "Entry Not Found") and said(refused, missing)
    assert hub_tree(lab) == before


def test_the_pinned_commit_arrives_when_main_moves_during_the_download(lab: Lab, hub):
    """Must-show 4: a new commit on main (new weights under the same names) right after the role read
    the file list; the role pins the older commit and gets exactly its bytes."""
    repo, olah = hub["repo"], hub["olah"]
    pinned = hub["small"]
    before = len(olah.requests())
    moved = {}

    def move_main():
        while not any("/tree/" + pinned in r for r in olah.requests()[before:]):
            time.sleep(0.05)
        weights = next(name for name in hub["files"] if name.endswith(".safetensors"))
        changed = {**hub["files"], "config.json": hub["files"]["config.json"].replace(b"{", b'{"moved": true, ', 1),
                   weights: os.urandom(len(hub["files"][weights]))}
        moved["commit"] = repo.commit(changed, "new weights on main")

    lab.sh(f"rm -rf {HUB_DIR} /models/.tiny-llama-hub.*")  # so that the files are fetched again
    mover = threading.Thread(target=move_main, daemon=True)
    mover.start()
    result = model_play(lab, hf_vars(hub, pinned))
    mover.join(timeout=60)
    assert result.rc == 0, result.output[-4000:]
    assert moved.get("commit") and git(repo.path, "rev-parse", "main") == moved["commit"] != pinned
    assert hub_tree(lab) == {n: hashlib.sha256(d).hexdigest() for n, d in hub["files"].items()}


def test_the_mirror_stopped_mid_run_is_named_and_the_next_run_completes(lab: Lab, hub):
    """Must-show 5."""
    olah = hub["olah"]
    before = hub_tree(lab)
    extra = hf_vars(hub, hub["big"])
    lab.sh("rm -rf /models/.tiny-llama-hub.staging-*")
    since = len(olah.requests())
    proc = start_model_play(lab, extra)
    wait_for_request(olah, "GET /" + REPO_ID + "/resolve/" + hub["big"] + "/assets/blob.dat", since)
    time.sleep(1.5)
    olah.stop(crash=True)
    out, _ = proc.communicate(timeout=600)
    assert proc.returncode != 0
    flat = " ".join(out.split())
    assert olah.url in flat and "downloading assets/blob.dat" in flat and "unchanged" in flat, out[-4000:]
    print("the refusal: " + next(line for line in out.splitlines() if olah.url in line).strip()[:600])
    assert hub_tree(lab) == before
    olah.start()
    again = model_play(lab, extra)
    assert again.rc == 0, again.output[-4000:]
    assert said(again, f"revision {hub['big']} in place"), again.output[-3000:]
    assert lab.sh(f"sha256sum {HUB_DIR}/assets/blob.dat").split()[0] == hub["repo"].lfs_sha256("assets/blob.dat")


def test_a_wrong_token_is_refused_naming_the_variable_and_the_right_one_downloads(lab: Lab, hub):
    """Must-show 6: a mirror that demands a token. olah cannot be set to check one itself; online, as a
    proxy, it asks its upstream whether the repository is visible with each caller's token and relays
    the refusal (tests/olah_server.py TokenGate: the upstream hub wants `Bearer <token>`)."""
    token = "hf_" + os.urandom(12).hex()
    gate = TokenGate(hub["olah"], token, address=lab.state.address).start()
    mirror = OlahProxy(hub["venv"], gate, hub["work"] / "gated", block_size=2 * BIG, address=lab.state.address)
    mirror.start()
    try:
        if not hub_tree(lab):  # run alone: a live folder to keep first
            assert model_play(lab, hf_vars(hub, hub["big"])).rc == 0
        before = hub_tree(lab)
        target = hub["small"] if before.get("assets/blob.dat") else hub["big"]
        for sent in ("", "hf_" + os.urandom(12).hex()):  # none, and a wrong one
            refused = model_play(lab, hf_vars(hub, target, model_weights_hf_endpoint=mirror.url,
                                               model_weights_token=sent))
            print(f"\ntoken {'wrong' if sent else 'none'}: rc={refused.rc}; the refusal: "
                  + next((line.strip() for line in refused.output.splitlines() if mirror.url in line), "?")[:700])
            assert refused.rc != 0
            assert said(refused, mirror.url) and said(refused, "401"), refused.output[-3000:]
            assert said(refused, "check model_weights_token"), refused.output[-3000:]
            assert not sent or sent not in refused.output  # the module's token parameter is no_log
            assert hub_tree(lab) == before
        # Refused at the gate itself, for this repository (olah's own start-up probes are refused there too).
        assert f"HEAD /api/models/{REPO_ID} 401" in gate.log, gate.log
        accepted = model_play(lab, hf_vars(hub, target, model_weights_hf_endpoint=mirror.url,
                                           model_weights_token=token))
        print(f"token right: rc={accepted.rc}; the gate saw: {gate.log}")
        assert accepted.rc == 0, accepted.output[-4000:]
        assert token not in accepted.output
        assert said(accepted, f"revision {target} in place"), accepted.output[-3000:]
        assert f"HEAD /api/models/{REPO_ID} 200" in gate.log, gate.log
        fetched = [line for line in gate.log if line.startswith(f"GET /{REPO_ID}/resolve/{target}/")]
        assert fetched and all(line.endswith(" 200") for line in fetched), gate.log
    finally:
        mirror.stop()
        gate.stop()
