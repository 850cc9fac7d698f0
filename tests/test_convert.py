"""Tests for service.venv.convert and service.host.safetensors_check on real checkpoints generated in tmp_path."""

from __future__ import annotations

import errno
import hashlib
import json
import os
import signal
import struct
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from service.host.safetensors_check import check_safetensors_dir, check_safetensors_file
from service.venv import convert

REPO_ROOT = Path(__file__).resolve().parent.parent
INDEX = "model.safetensors.index.json"


# ---------------------------------------------------------------- helpers


def run_cli(*args: str | Path, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    """The converter as Ansible runs it: a separate process, JSON on stdout."""
    return subprocess.run(
        [sys.executable, "-m", "service.venv.convert", *map(str, args)],
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
        env={**os.environ, **(env or {})},
        timeout=60,
    )


def run_in_process(capsys: pytest.CaptureFixture, *args: str | Path) -> subprocess.CompletedProcess:
    """Same entry point as the CLI, without paying for a fresh interpreter and torch import."""
    capsys.readouterr()
    returncode = convert.main([str(a) for a in args])
    captured = capsys.readouterr()
    return subprocess.CompletedProcess(list(args), returncode, captured.out, captured.err)


def last_json(stdout: str) -> dict:
    return json.loads(stdout.strip().splitlines()[-1])


def raw_bytes(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.contiguous().reshape(-1).view(torch.uint8)


def assert_same_bits(expected: dict[str, torch.Tensor], actual: dict[str, torch.Tensor]) -> None:
    assert set(actual) == set(expected)
    for name, tensor in expected.items():
        got = actual[name]
        assert got.dtype == tensor.dtype, name
        assert got.shape == tensor.shape, name
        assert torch.equal(raw_bytes(got), raw_bytes(tensor)), name


def load_converted(model_dir: Path) -> dict[str, torch.Tensor]:
    """Every original key back from the safetensors output: stored tensors plus recorded aliases."""
    weight_map = json.loads((model_dir / INDEX).read_text())["weight_map"]
    state: dict[str, torch.Tensor] = {}
    for file_name in sorted(set(weight_map.values())):
        tensors = load_file(model_dir / file_name)
        with safe_open(model_dir / file_name, framework="pt") as f:
            aliases = json.loads((f.metadata() or {}).get("gptoss_aliases", "{}"))
        state.update(tensors)
        state.update({alias: tensors[target] for alias, target in aliases.items()})
    assert set(state) == set(weight_map)
    return state


def sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def snapshot(directory: Path) -> dict[str, tuple[int, int, str]]:
    """Name -> (size, mtime_ns, sha256) of every entry, to prove a run wrote nothing."""
    return {
        p.name: (p.stat().st_size, p.stat().st_mtime_ns, sha256(p))
        for p in sorted(directory.iterdir())
        if p.is_file()
    }


def random_state(seed: int, prefix: str = "layer", count: int = 4, rows: int = 64) -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    dtypes = [torch.bfloat16, torch.float32, torch.float16, torch.float32]
    return {
        f"{prefix}.{i}.weight": torch.randn(rows, 128, generator=generator).to(dtypes[i % len(dtypes)])
        for i in range(count)
    }


def make_sharded(model_dir: Path, shards: list[dict[str, torch.Tensor]]) -> list[Path]:
    """HF-style pytorch_model-XXXXX-of-YYYYY.bin files plus pytorch_model.bin.index.json."""
    model_dir.mkdir(parents=True, exist_ok=True)
    weight_map, paths = {}, []
    for number, state in enumerate(shards, start=1):
        name = f"pytorch_model-{number:05d}-of-{len(shards):05d}.bin"
        torch.save(state, model_dir / name)
        weight_map.update(dict.fromkeys(state, name))
        paths.append(model_dir / name)
    index = {"metadata": {"total_size": sum(p.stat().st_size for p in paths)}, "weight_map": weight_map}
    (model_dir / "pytorch_model.bin.index.json").write_text(json.dumps(index))
    return paths


def merged(shards: list[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    return {name: tensor for shard in shards for name, tensor in shard.items()}


# ---------------------------------------------------------------- conversions that succeed


def test_single_file_checkpoint_converts_and_verifies(tmp_path: Path) -> None:
    state = random_state(1)
    torch.save(state, tmp_path / "pytorch_model.bin")
    result = run_cli(tmp_path, "--json", "--no-progress")
    assert result.returncode == 0, result.stderr
    summary = last_json(result.stdout)
    assert summary["changed"] is True and summary["action"] == "converted" and summary["shards"] == 1
    assert summary["bytes"] == sum(t.numel() * t.element_size() for t in state.values())
    assert "converted 1 shard" in result.stderr and "verified bit-for-bit" in result.stderr
    assert (tmp_path / "model-00001-of-00001.safetensors").is_file()
    assert check_safetensors_dir(tmp_path) == []
    assert_same_bits(state, load_converted(tmp_path))
    assert (tmp_path / "pytorch_model.bin").exists()  # originals kept without --delete-originals
    assert not list(tmp_path.glob(".*tmp-*"))


def test_sharded_checkpoint_with_index(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    shards = [random_state(seed, prefix=f"block{seed}") for seed in range(3)]
    make_sharded(tmp_path, shards)
    result = run_in_process(capsys, tmp_path, "--json", "--no-progress")
    assert result.returncode == 0, result.stderr
    index = json.loads((tmp_path / INDEX).read_text())
    names = [f"model-{i:05d}-of-00003.safetensors" for i in (1, 2, 3)]
    assert sorted(set(index["weight_map"].values())) == names
    for number, shard in enumerate(shards):
        assert all(index["weight_map"][key] == names[number] for key in shard)
    assert index["metadata"]["total_size"] == sum(
        t.numel() * t.element_size() for t in merged(shards).values()
    )
    assert_same_bits(merged(shards), load_converted(tmp_path))
    assert last_json(result.stdout)["files"][-1].endswith(INDEX)


def test_tied_embeddings_stored_once_and_aliased(tmp_path: Path) -> None:
    embed = torch.randn(100, 16).to(torch.bfloat16)
    state = {
        "model.embed_tokens.weight": embed,
        "model.norm.weight": torch.ones(16),
        "lm_head.weight": embed,
    }
    torch.save(state, tmp_path / "pytorch_model.bin")
    assert convert.main([str(tmp_path), "--no-progress"]) == 0
    shard = tmp_path / "model-00001-of-00001.safetensors"
    with safe_open(shard, framework="pt") as f:
        stored = set(f.keys())
        aliases = json.loads(f.metadata()["gptoss_aliases"])
    assert stored == {"model.embed_tokens.weight", "model.norm.weight"}
    assert aliases == {"lm_head.weight": "model.embed_tokens.weight"}
    weight_map = json.loads((tmp_path / INDEX).read_text())["weight_map"]
    assert weight_map["lm_head.weight"] == weight_map["model.embed_tokens.weight"] == shard.name
    assert_same_bits(state, load_converted(tmp_path))


def test_exact_dtypes_and_bit_patterns_including_nan(tmp_path: Path) -> None:
    nan_payloads = torch.tensor([0x7FC00001, -0x003FFFFF, 0x7F800001, -0x80000000], dtype=torch.int32)
    state = {
        "f32_nans": nan_payloads.view(torch.float32),  # quiet/signalling NaNs with payloads, -0.0
        "bf16_nan": torch.tensor([0x7FC1, -0x8000, 0x0001], dtype=torch.int16).view(torch.bfloat16),
        "bf16": torch.randn(33, 7).to(torch.bfloat16),
        "fp16": torch.randn(5, 3).to(torch.float16),
        "fp32": torch.randn(17),
        "fp64": torch.randn(3, dtype=torch.float64),
        "int8": torch.randint(-128, 127, (31,), dtype=torch.int8),
        "uint8": torch.randint(0, 255, (9,), dtype=torch.uint8),
        "int64": torch.arange(-5, 5, dtype=torch.int64),
        "bool": torch.tensor([True, False, True]),
        "f8": torch.randn(12).to(torch.float8_e4m3fn),
        "scalar": torch.tensor(3.5),
        "empty": torch.empty(0, 4),
    }
    torch.save(state, tmp_path / "pytorch_model.bin")
    assert convert.main([str(tmp_path), "--no-progress"]) == 0
    converted = load_converted(tmp_path)
    assert_same_bits(state, converted)
    assert torch.isnan(converted["f32_nans"][:3]).all()


def test_non_contiguous_and_overlapping_views(tmp_path: Path) -> None:
    base = torch.randn(8, 12)
    state = {
        "transposed": torch.randn(6, 10).t(),
        "strided": torch.arange(100, dtype=torch.float32)[::3],
        "base": base,
        "row_of_base": base[2],  # overlaps "base" but is a different view: stored separately
        "column_of_base": base[:, 5],
    }
    assert not state["transposed"].is_contiguous()
    torch.save(state, tmp_path / "pytorch_model.bin")
    assert convert.main([str(tmp_path), "--no-progress"]) == 0
    assert_same_bits(state, load_converted(tmp_path))


def test_mapped_tensors_are_located_in_the_source_file(tmp_path: Path) -> None:
    """The in-kernel copy path: every contiguous tensor of a zip checkpoint is found at a file
    offset whose bytes are exactly the tensor's bytes; a non-contiguous view is not (it is copied)."""
    base = torch.randn(64, 32)
    state = {**random_state(5), "transposed": base.t(), "empty": torch.empty(0)}
    path = tmp_path / "pytorch_model.bin"
    torch.save(state, path)
    loaded, mmap_backed = convert.load_checkpoint(path)
    plan = convert.plan_shard(loaded, mmap_backed, path)
    spans = convert.source_file_spans(plan)
    assert set(spans) == set(random_state(5))
    data = path.read_bytes()
    for name, offset in spans.items():
        tensor = loaded[name]
        nbytes = tensor.numel() * tensor.element_size()
        assert data[offset : offset + nbytes] == bytes(raw_bytes(tensor).numpy()), name


def test_byte_comparison_sees_one_flipped_bit_anywhere() -> None:
    data = torch.randint(0, 256, (1 << 20,), dtype=torch.uint8)
    assert convert.bytes_equal(data, data.clone())
    for position in (0, 12345, data.numel() - 1):
        changed = data.clone()
        changed[position] ^= 1
        assert not convert.bytes_equal(data, changed), position
    assert not convert.bytes_equal(data, data[:-1])
    assert convert.bytes_equal(data[:0], data[:0])


@pytest.mark.parametrize("how", ["unsupported", "missing"])
def test_write_falls_back_without_copy_file_range(tmp_path: Path, capsys: pytest.CaptureFixture,
                                                  monkeypatch: pytest.MonkeyPatch, how: str) -> None:
    def unsupported(*_args: object, **_kwargs: object) -> int:
        raise OSError(errno.EXDEV, "Invalid cross-device link")

    if how == "missing":
        monkeypatch.delattr(os, "copy_file_range")
    else:
        monkeypatch.setattr(os, "copy_file_range", unsupported)
    shards = [random_state(seed, prefix=f"fallback{seed}") for seed in range(2)]
    make_sharded(tmp_path, shards)
    assert run_in_process(capsys, tmp_path, "--no-progress").returncode == 0
    assert_same_bits(merged(shards), load_converted(tmp_path))


def test_pt_file_is_converted(tmp_path: Path) -> None:
    state = random_state(7, count=2)
    torch.save(state, tmp_path / "weights.pt")
    assert convert.main([str(tmp_path), "--no-progress"]) == 0
    assert_same_bits(state, load_converted(tmp_path))


def test_pt_files_next_to_bin_weights_are_ignored(tmp_path: Path) -> None:
    state = random_state(8, count=2)
    torch.save(state, tmp_path / "pytorch_model.bin")
    torch.save({"step": 3}, tmp_path / "rng_state.pt")  # not weights: must not be picked up
    assert convert.main([str(tmp_path), "--no-progress"]) == 0
    assert_same_bits(state, load_converted(tmp_path))


def test_second_run_is_unchanged_and_delete_originals(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    shards = [random_state(11), random_state(12, prefix="other")]
    sources = make_sharded(tmp_path, shards)
    assert run_in_process(capsys, tmp_path, "--no-progress").returncode == 0
    again = run_in_process(capsys, tmp_path, "--json", "--no-progress")
    assert again.returncode == 0, again.stderr
    assert last_json(again.stdout)["changed"] is False
    assert last_json(again.stdout)["action"] == "verified"
    deleted = run_in_process(capsys, tmp_path, "--json", "--delete-originals", "--no-progress")
    assert deleted.returncode == 0, deleted.stderr
    assert last_json(deleted.stdout)["changed"] is True
    assert not any(p.exists() for p in sources)
    assert not (tmp_path / "pytorch_model.bin.index.json").exists()
    assert_same_bits(merged(shards), load_converted(tmp_path))
    after = run_in_process(capsys, tmp_path, "--json", "--no-progress")
    assert after.returncode == 0 and last_json(after.stdout)["changed"] is False
    assert "nothing to convert" in after.stderr


def test_delete_originals_in_one_go(tmp_path: Path) -> None:
    state = random_state(13)
    torch.save(state, tmp_path / "pytorch_model.bin")
    assert convert.main([str(tmp_path), "--delete-originals", "--no-progress"]) == 0
    assert not (tmp_path / "pytorch_model.bin").exists()
    assert_same_bits(state, load_converted(tmp_path))


def test_corrupted_output_shard_is_detected_and_rewritten(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    state = random_state(14)
    torch.save(state, tmp_path / "pytorch_model.bin")
    assert convert.main([str(tmp_path), "--no-progress"]) == 0
    shard = tmp_path / "model-00001-of-00001.safetensors"
    data = bytearray(shard.read_bytes())
    data[-3] ^= 0xFF  # same size, valid header: only a byte comparison can notice
    shard.write_bytes(bytes(data))
    assert check_safetensors_file(shard) == []
    result = run_in_process(capsys, tmp_path, "--json", "--no-progress")
    assert result.returncode == 0, result.stderr
    assert "differs from pytorch_model.bin" in result.stderr
    assert last_json(result.stdout)["changed"] is True
    assert_same_bits(state, load_converted(tmp_path))


# ---------------------------------------------------------------- refusals and failures


def test_truncated_bin_fails_cleanly(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    source = tmp_path / "pytorch_model.bin"
    torch.save(random_state(2), source)
    source.write_bytes(source.read_bytes()[: source.stat().st_size // 2])
    before = snapshot(tmp_path)
    result = run_in_process(capsys, tmp_path, "--json", "--no-progress")
    assert result.returncode == 1
    assert "error:" in result.stderr and "pytorch_model.bin" in result.stderr
    assert last_json(result.stdout)["failed"] is True
    assert snapshot(tmp_path) == before


def test_malicious_pickle_is_refused_and_never_run(tmp_path: Path) -> None:
    live_marker, marker = tmp_path / "payload-is-live", tmp_path / "payload-ran"

    class Payload:
        def __init__(self, target: Path) -> None:
            self.target = target

        def __reduce__(self) -> tuple:
            return (os.system, (f"touch {self.target}",))

    probe = tmp_path / "probe" / "probe.bin"
    probe.parent.mkdir()
    torch.save({"w": torch.zeros(2), "x": Payload(live_marker)}, probe)
    torch.load(probe, weights_only=False)  # proves the payload really executes when unpickled unsafely
    assert live_marker.exists()
    model = tmp_path / "model"
    # The bad pickle is shard 2: the preflight must refuse before shard 1 is written.
    paths = make_sharded(model, [random_state(3), {"w": torch.zeros(2)}])
    torch.save({"w": torch.zeros(2), "x": Payload(marker)}, paths[1])
    before = snapshot(model)
    result = run_cli(model, "--no-progress")
    assert result.returncode == 1
    assert "refused" in result.stderr and paths[1].name in result.stderr
    assert not marker.exists()
    assert snapshot(model) == before


def test_non_tensor_values_are_refused(tmp_path: Path) -> None:
    torch.save({"w": torch.zeros(2), "step": 5}, tmp_path / "pytorch_model.bin")
    assert convert.main([str(tmp_path), "--no-progress"]) == 1
    assert not list(tmp_path.glob("*.safetensors"))


def test_foreign_file_with_output_name_is_not_overwritten(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    torch.save(random_state(4), tmp_path / "pytorch_model.bin")
    foreign = tmp_path / "model-00001-of-00001.safetensors"
    save_file({"other": torch.ones(3)}, foreign)
    digest = sha256(foreign)
    result = run_in_process(capsys, tmp_path, "--no-progress")
    assert result.returncode == 1 and "refusing to overwrite" in result.stderr
    assert sha256(foreign) == digest
    assert not (tmp_path / INDEX).exists()


def test_usage_errors_exit_2(tmp_path: Path) -> None:
    assert convert.main([str(tmp_path / "missing")]) == 2
    assert run_cli(tmp_path, "--bogus").returncode == 2


# ---------------------------------------------------------------- check mode and safetensors models


def test_check_mode_writes_nothing(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    make_sharded(tmp_path, [random_state(5), random_state(6, prefix="b")])
    before = snapshot(tmp_path)
    result = run_in_process(capsys, tmp_path, "--check", "--json", "--delete-originals")
    assert result.returncode == 0, result.stderr
    summary = last_json(result.stdout)
    assert summary["changed"] is True and summary["action"] == "would_convert" and summary["shards"] == 2
    assert snapshot(tmp_path) == before
    assert convert.main([str(tmp_path), "--no-progress"]) == 0
    converted = snapshot(tmp_path)
    summary = last_json(run_in_process(capsys, tmp_path, "--check", "--json").stdout)
    assert (summary["changed"], summary["action"], summary["shards"]) == (False, "verified", 0)
    assert snapshot(tmp_path) == converted


def test_already_safetensors_model_is_left_alone(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    # Upstream layout (gpt-oss ships 0-based shard names): must be accepted as it is.
    for name, tensors in [("model-00000-of-00002", {"a": torch.randn(4, 4)}), ("model-00001-of-00002",
                                                                                {"b": torch.randn(3)})]:
        save_file(tensors, tmp_path / f"{name}.safetensors", metadata={"format": "pt"})
    index = {"metadata": {"total_size": 76}, "weight_map": {
        "a": "model-00000-of-00002.safetensors", "b": "model-00001-of-00002.safetensors"}}
    (tmp_path / INDEX).write_text(json.dumps(index))
    before = snapshot(tmp_path)
    result = run_in_process(capsys, tmp_path, "--json", "--delete-originals")
    assert result.returncode == 0, result.stderr
    assert "nothing to convert: 2 safetensors file(s)" in result.stderr
    summary = last_json(result.stdout)
    assert (summary["changed"], summary["action"], summary["shards"]) == (False, "verified", 2)
    assert snapshot(tmp_path) == before
    shard = tmp_path / "model-00001-of-00002.safetensors"
    shard.write_bytes(shard.read_bytes()[:-4])
    broken = run_in_process(capsys, tmp_path, "--json")
    assert broken.returncode == 1 and shard.name in broken.stderr and "truncated" in broken.stderr


# ---------------------------------------------------------------- disk full, kill and resume


def wait_for_stop_point(process: subprocess.Popen, event: str) -> None:
    """Read stderr until the converter announces the stop point, then until it is really stopped."""
    for line in process.stderr:
        if line.strip() == f"stop-point: {event}":
            break
    else:
        raise AssertionError(f"converter exited before stop point {event}: rc={process.wait()}")
    deadline = time.monotonic() + 10
    while Path(f"/proc/{process.pid}/stat").read_text().split(")")[-1].split()[0] != "T":
        assert time.monotonic() < deadline, "converter did not stop"
        time.sleep(0.01)


def start_cli(model_dir: Path, stop_at: str, jobs: int = 1) -> subprocess.Popen:
    """One shard at a time by default, so the files on disk at a stop point are exactly known."""
    return subprocess.Popen(
        [sys.executable, "-m", "service.venv.convert", str(model_dir), "--json", "--no-progress", "--jobs", str(jobs)],
        cwd=REPO_ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env={**os.environ, convert.STOP_AT_ENV: stop_at},
    )


def test_killed_run_leaves_no_partial_output_and_resumes(tmp_path: Path) -> None:
    shards = [random_state(20 + i, prefix=f"s{i}", rows=1024) for i in range(3)]
    make_sharded(tmp_path, shards)
    process = start_cli(tmp_path, "partial:2")
    try:
        wait_for_stop_point(process, "partial:2")
        first = tmp_path / "model-00001-of-00003.safetensors"
        temps = list(tmp_path.glob(".model-00002-of-00003.safetensors.tmp-*"))
        assert first.is_file() and len(temps) == 1
        assert not (tmp_path / "model-00002-of-00003.safetensors").exists()
    finally:
        process.send_signal(signal.SIGKILL)
        process.wait()
        process.stdout.close()
        process.stderr.close()
    assert not (tmp_path / INDEX).exists()  # not "converted" until the index is written
    first_identity = (first.stat().st_ino, first.stat().st_mtime_ns)
    resumed = run_cli(tmp_path, "--json", "--no-progress")
    assert resumed.returncode == 0, resumed.stderr
    summary = last_json(resumed.stdout)
    assert summary["action"] == "resumed" and summary["changed"] is True
    assert "wrote 2 shard(s)" in resumed.stderr and "skipped 1" in resumed.stderr
    assert (first.stat().st_ino, first.stat().st_mtime_ns) == first_identity
    assert not temps[0].exists()
    assert check_safetensors_dir(tmp_path) == []
    assert_same_bits(merged(shards), load_converted(tmp_path))


def test_killed_parallel_run_leaves_only_complete_shards_and_resumes(tmp_path: Path) -> None:
    """--jobs 2: killed while shard 2 is half written (shard 1 may still be in flight too)."""
    shards = [random_state(40 + i, prefix=f"p{i}", rows=1024) for i in range(4)]
    make_sharded(tmp_path, shards)
    process = start_cli(tmp_path, "partial:2", jobs=2)
    try:
        wait_for_stop_point(process, "partial:2")
        assert len(list(tmp_path.glob(".model-00002-of-00004.safetensors.tmp-*"))) == 1
    finally:
        process.send_signal(signal.SIGKILL)
        process.wait()
        process.stdout.close()
        process.stderr.close()
    assert not (tmp_path / "model-00002-of-00004.safetensors").exists() and not (tmp_path / INDEX).exists()
    finished = sorted(tmp_path.glob("model-*.safetensors"))
    for path in finished:  # anything published is complete
        assert check_safetensors_file(path) == []
    resumed = run_cli(tmp_path, "--json", "--no-progress", "--jobs", "2")
    assert resumed.returncode == 0, resumed.stderr
    if finished:
        assert f"skipped {len(finished)} already converted" in resumed.stderr
    else:  # shard 1 was still in flight at the kill
        assert "converted 4 shard(s)" in resumed.stderr
    assert not list(tmp_path.glob(".*tmp-*"))
    assert check_safetensors_dir(tmp_path) == []
    assert_same_bits(merged(shards), load_converted(tmp_path))


def test_sigterm_mid_write_removes_temp(tmp_path: Path) -> None:
    state = random_state(25, rows=1024)
    torch.save(state, tmp_path / "pytorch_model.bin")
    process = start_cli(tmp_path, "partial:1")
    try:
        wait_for_stop_point(process, "partial:1")
        assert len(list(tmp_path.glob(".model-00001-of-00001.safetensors.tmp-*"))) == 1
        process.send_signal(signal.SIGTERM)  # pending while stopped, delivered on SIGCONT
        process.send_signal(signal.SIGCONT)
        process.communicate(timeout=60)
    finally:
        if process.poll() is None:
            process.kill()
            process.communicate()
    assert process.returncode == 128 + signal.SIGTERM
    # The temp file is gone. The writer thread may have finished and published the (tiny) shard
    # before the main thread handled the signal: then it is complete, as after any kill.
    left = sorted(p.name for p in tmp_path.iterdir())
    assert left in (["pytorch_model.bin"], ["model-00001-of-00001.safetensors", "pytorch_model.bin"])
    if len(left) == 2:
        assert check_safetensors_file(tmp_path / left[0]) == []


@pytest.fixture
def small_fs(tmp_path: Path) -> Iterator[callable]:
    """Mount tmpfs filesystems of a given size (needs root); skipped where mounting is not allowed."""
    mounted: list[Path] = []

    def mount(size_mb: int) -> Path:
        target = tmp_path / f"fs{len(mounted)}"
        target.mkdir()
        try:
            result = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size_mb}M", "tmpfs", str(target)],
                                    capture_output=True, text=True)
        except FileNotFoundError:
            pytest.skip("no mount command")
        if result.returncode != 0:
            pytest.skip(f"cannot mount tmpfs here: {result.stderr.strip()}")
        mounted.append(target)
        return target

    yield mount
    for target in mounted:
        subprocess.run(["umount", str(target)], check=False)


def test_not_enough_space_fails_before_writing(tmp_path: Path, capsys: pytest.CaptureFixture,
                                               small_fs) -> None:
    model = small_fs(24)
    torch.save(random_state(30, rows=8192, count=4), model / "pytorch_model.bin")  # ~12 MB
    before = snapshot(model)
    result = run_in_process(capsys, model, "--no-progress")
    assert result.returncode == 1
    assert "not enough free space" in result.stderr and str(model) in result.stderr
    assert snapshot(model) == before


@pytest.mark.parametrize(("shard_count", "jobs"), [(1, 1), (2, 1), (3, 2)])
def test_disk_full_mid_write_removes_temp_and_keeps_originals(tmp_path: Path, capsys: pytest.CaptureFixture,
                                                              small_fs, shard_count: int, jobs: int) -> None:
    model = small_fs(32 * shard_count + 32)  # sources + outputs + slack
    shards = [random_state(31 + i, prefix=f"s{i}", rows=8192) for i in range(shard_count)]  # ~12.6 MB each
    sources = make_sharded(model, shards)
    originals = {p.name: sha256(p) for p in sources}
    shard_bytes = sum(t.numel() * t.element_size() for t in shards[0].values())
    process = start_cli(model, "after-space-check", jobs=jobs)
    try:
        wait_for_stop_point(process, "after-space-check")
        # Another writer takes the space after the converter checked it: room for half the last shard.
        free = os.statvfs(model).f_bavail * os.statvfs(model).f_frsize
        with (model / "filler").open("wb") as f:
            f.write(b"\0" * int(free - (shard_count - 0.5) * shard_bytes))
        process.send_signal(signal.SIGCONT)
        _, stderr = process.communicate(timeout=60)
    finally:
        if process.poll() is None:
            process.kill()
            process.communicate()
    assert process.returncode == 1
    last = f"model-{shard_count:05d}-of-{shard_count:05d}.safetensors"
    assert "no space left on device" in stderr
    if jobs == 1:  # in order: the last shard is the one that finds the disk full
        assert last in stderr and not (model / last).exists()
    else:  # two jobs write at once: whichever shard is being written when the space runs out names it, and
        # on a busy machine a descheduled first shard can be that one (seen in CI), not only the last two
        assert any(f"model-{n:05d}-of-{shard_count:05d}.safetensors" in stderr for n in range(1, shard_count + 1))
    assert not list(model.glob(".*tmp-*")) and not (model / INDEX).exists()
    for earlier in model.glob("model-*.safetensors"):  # a shard finished before the disk filled up
        assert check_safetensors_file(earlier) == []
    assert {p.name: sha256(p) for p in sources} == originals
    (model / "filler").unlink()
    assert run_in_process(capsys, model, "--no-progress").returncode == 0
    assert_same_bits(merged(shards), load_converted(model))


# ---------------------------------------------------------------- safetensors_check on its own


def write_raw_safetensors(path: Path, header: dict, data: bytes) -> None:
    encoded = json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", len(encoded)) + encoded + data)


def test_check_flags_bad_sizes_gaps_and_truncation(tmp_path: Path) -> None:
    good = tmp_path / "good.safetensors"
    save_file({"a": torch.randn(3, 5), "b": torch.zeros(2, dtype=torch.int8)}, good)
    assert check_safetensors_file(good) == []
    short = tmp_path / "short.safetensors"
    short.write_bytes(good.read_bytes()[:-1])
    problem = check_safetensors_file(short)[0]
    assert "truncated" in problem and "short.safetensors" in problem
    wrong = tmp_path / "wrong.safetensors"
    write_raw_safetensors(wrong, {"a": {"dtype": "F32", "shape": [2], "data_offsets": [0, 4]}}, b"\0" * 4)
    assert "needs 8" in check_safetensors_file(wrong)[0]
    gap = tmp_path / "gap.safetensors"
    write_raw_safetensors(gap, {"a": {"dtype": "U8", "shape": [4], "data_offsets": [0, 4]},
                                "b": {"dtype": "U8", "shape": [4], "data_offsets": [8, 12]}}, b"\0" * 12)
    assert "gap" in check_safetensors_file(gap)[0]
    padded = tmp_path / "padded.safetensors"
    padded.write_bytes(good.read_bytes() + b"\0")
    assert "trailing" in check_safetensors_file(padded)[0]


def test_check_dir_follows_the_index(tmp_path: Path) -> None:
    save_file({"a": torch.ones(2)}, tmp_path / "one.safetensors")
    def write_index(weight_map: dict[str, str]) -> None:
        (tmp_path / INDEX).write_text(json.dumps({"weight_map": weight_map}))

    write_index({"a": "one.safetensors", "b": "two.safetensors"})
    assert any("two.safetensors" in p and "does not exist" in p for p in check_safetensors_dir(tmp_path))
    write_index({"a": "one.safetensors", "c": "one.safetensors"})
    assert any("'c'" in p for p in check_safetensors_dir(tmp_path))
    write_index({"a": "one.safetensors"})
    assert check_safetensors_dir(tmp_path) == []


def test_check_runs_under_system_python_without_torch(tmp_path: Path) -> None:
    system_python = Path("/usr/bin/python3")
    if not system_python.exists():
        pytest.skip("no /usr/bin/python3")
    save_file({"a": torch.ones(2)}, tmp_path / "model.safetensors")
    # Exit status 10+ would mean the checker pulled in torch.
    code = ("import sys, service.host.safetensors_check as c; "
            "sys.exit(c.main(sys.argv[1:]) + 10 * ('torch' in sys.modules))")

    def check() -> subprocess.CompletedProcess:
        return subprocess.run([str(system_python), "-c", code, str(tmp_path)], cwd=REPO_ROOT,
                              capture_output=True, text=True)

    ok = check()
    assert ok.returncode == 0, ok.stderr
    (tmp_path / "model.safetensors").write_bytes(b"\x10\0\0\0\0\0\0\0{}")
    bad = check()
    assert bad.returncode == 1 and "model.safetensors" in bad.stdout


def test_a_safetensors_model_is_checked_without_importing_torch(tmp_path: Path) -> None:
    # The role runs the converter on every converge: a model that ships safetensors (gpt-oss) must
    # not pay torch's import (~1.8 s on the 2-core box) just to be checked; a .bin model needs it.
    save_file({"a": torch.ones(2)}, tmp_path / "model.safetensors")
    code = ("import sys; from service.venv import convert; "
            "sys.exit(convert.main([sys.argv[1], '--json', '--no-progress']) + 10 * ('torch' in sys.modules))")

    def converter_exit(model_dir: Path) -> int:
        return subprocess.run([sys.executable, "-c", code, str(model_dir)], cwd=REPO_ROOT, capture_output=True,
                              text=True, timeout=120).returncode

    assert converter_exit(tmp_path) == 0
    bin_model = tmp_path / "bin"
    bin_model.mkdir()
    torch.save({"a": torch.ones(2)}, bin_model / "pytorch_model.bin")
    assert converter_exit(bin_model) == 10
