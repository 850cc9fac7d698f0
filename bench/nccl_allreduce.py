"""All-reduce bandwidth and latency under each NCCL environment file the nccl_env role can write.

    python bench/nccl_allreduce.py [--variants role-default,p2p-on,p2p-off,ib-off] [--sizes 1MiB,...,1GiB]
                                   [--world-size N] [--backend nccl|gloo] [--nvml] [--json OUT]

For each variant the file body comes from the role's own rule (module_utils/nccl_policy.py: the
same function the `gptoss.host.nccl_policy` module runs), applied to this machine's NVML report.
It is written to --out-dir, and a fresh set of worker processes (one per GPU, torch.distributed)
starts with exactly those variables: NCCL reads its environment once, at communicator creation,
so every variant needs new processes. Every process also gets NVLink multicast off
(NCCL_NVLS_ENABLE=0, TORCH_SYMM_MEM_DISABLE_MULTICAST=1, NVSHMEM_DISABLE_NVLS=1).

Per size, rank 0 reports the mean time of one all-reduce over --iters (after --warmup), the
algorithm bandwidth (bytes / time) and the bus bandwidth (algbw x 2(n-1)/n, the nccl-tests
convention that makes ring all-reduce comparable across GPU counts). --nvml samples every GPU
during each variant (controller.bench's sampler: SM utilization where NVML has GPM, utilization.gpu,
memory). `--backend gloo` runs the same code on CPUs (the test suite does that; it proves the
plumbing and that each file's variables reach the workers, not NCCL speed).
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT), str(ROOT / "collections")]

from ansible_collections.gptoss.host.plugins.module_utils import nccl_policy  # noqa: E402

# NVLink multicast stays off in every process (the lent multi-GPU machines require it).
MULTICAST_OFF = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1"}
# name -> (nccl_env_p2p policy, nccl_env_ib_disable), i.e. the role's inputs for each file.
VARIANTS: dict[str, tuple[str, bool]] = {
    "role-default": ("auto", True),   # what the role writes with its defaults on this machine
    "p2p-on": ("enable", False),
    "p2p-off": ("disable", False),
    "ib-off": ("enable", True),
}
DEFAULT_SIZES = "1MiB,4MiB,16MiB,64MiB,256MiB,1GiB"
UNITS = {"KiB": 1 << 10, "MiB": 1 << 20, "GiB": 1 << 30}


def parse_size(text: str) -> int:
    for unit, factor in UNITS.items():
        if text.endswith(unit):
            return int(text[: -len(unit)]) * factor
    return int(text)


def bus_bandwidth(algbw: float, world_size: int) -> float:
    """nccl-tests' all-reduce bus bandwidth: each rank sends and receives 2(n-1)/n of the buffer."""
    return algbw * 2 * (world_size - 1) / world_size


def nvml_report() -> dict[str, Any]:
    """This machine's `service.host.nvidia --json` fields that the P2P rule reads."""
    from service.host import nvidia

    snapshot = nvidia.nvml_snapshot()
    return {**snapshot, "p2p_supported_all_pairs": nvidia.p2p_supported_all_pairs(snapshot),
            "p2p_reason": nvidia.p2p_reason(snapshot)}


def env_file_variables(path: Path) -> dict[str, str]:
    """KEY=VALUE lines of an EnvironmentFile the role wrote (comments skipped, values as written)."""
    variables = {}
    for line in path.read_text().splitlines():
        if line.strip() and not line.lstrip().startswith("#"):
            name, _, value = line.partition("=")
            variables[name.strip()] = value
    return variables


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def run_variant(env_file: Path, args: argparse.Namespace) -> dict[str, Any]:
    """Start one worker per rank under the file's variables; return rank 0's measurements."""
    port = free_port()
    base_env = {k: v for k, v in os.environ.items() if not k.startswith(("NCCL_", "TORCH_NCCL_"))}
    env = {**base_env, **env_file_variables(env_file), **MULTICAST_OFF, "PYTHONUNBUFFERED": "1"}
    workers = [subprocess.Popen([sys.executable, __file__, "--worker", str(rank), "--world-size", str(args.world_size),
                                 "--backend", args.backend, "--port", str(port), "--sizes", args.sizes,
                                 "--iters", str(args.iters), "--warmup", str(args.warmup)],
                                env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
               for rank in range(args.world_size)]
    outputs = []
    for rank, proc in enumerate(workers):
        try:
            out, err = proc.communicate(timeout=args.timeout)
        except subprocess.TimeoutExpired:
            for other in workers:
                other.kill()
            raise SystemExit(f"nccl_allreduce: rank {rank} did not finish within {args.timeout}s") from None
        if proc.returncode != 0:
            raise SystemExit(f"nccl_allreduce: rank {rank} failed (exit {proc.returncode}):\n{err[-3000:]}")
        outputs.append(json.loads(out.strip().splitlines()[-1]))
    return {"env_file": str(env_file), "ranks_env": [o["env"] for o in outputs], **outputs[0]["result"]}


def worker(rank: int, args: argparse.Namespace) -> None:
    import torch
    import torch.distributed as dist

    device = torch.device("cuda", rank) if args.backend == "nccl" else torch.device("cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    dist.init_process_group(args.backend, init_method=f"tcp://127.0.0.1:{args.port}", rank=rank,
                            world_size=args.world_size, device_id=device if device.type == "cuda" else None)

    def sync() -> None:
        if device.type == "cuda":
            torch.cuda.synchronize(device)

    rows = []
    for size in [parse_size(s) for s in args.sizes.split(",")]:
        buffer = torch.ones(size // 4, dtype=torch.float32, device=device)
        for _ in range(args.warmup):
            dist.all_reduce(buffer)
        sync()
        dist.barrier()
        started = time.perf_counter()
        for _ in range(args.iters):
            dist.all_reduce(buffer)
        sync()
        seconds = (time.perf_counter() - started) / args.iters
        algbw = size / seconds / 1e9
        rows.append({"bytes": size, "time_us": seconds * 1e6, "algbw_gbs": algbw,
                     "busbw_gbs": bus_bandwidth(algbw, args.world_size)})
        del buffer
    device_name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    dist.destroy_process_group()
    seen = {k: v for k, v in os.environ.items() if k.startswith(("NCCL_", "TORCH_NCCL_", "NVSHMEM_", "TORCH_SYMM"))}
    print(json.dumps({"env": seen, "result": {"world_size": args.world_size, "backend": args.backend,
                                              "device": device_name, "torch": torch.__version__,
                                              "nccl": ".".join(map(str, torch.cuda.nccl.version()))
                                              if device.type == "cuda" else None, "sizes": rows}}))


def render(results: dict[str, dict[str, Any]]) -> str:
    names = list(results)
    header = f"{'size':>8} " + " ".join(f"{n + ' busbw GB/s':>22} {n + ' us':>16}" for n in names)
    lines = [header]
    sizes = [row["bytes"] for row in next(iter(results.values()))["sizes"]]
    for index, size in enumerate(sizes):
        label = next((f"{size // f}{u}" for u, f in reversed(UNITS.items()) if size % f == 0), str(size))
        cells = []
        for name in names:
            row = results[name]["sizes"][index]
            cells.append(f"{row['busbw_gbs']:>22.2f} {row['time_us']:>16.1f}")
        lines.append(f"{label:>8} " + " ".join(cells))
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--variants", default=",".join(VARIANTS), help=f"comma-separated, from {', '.join(VARIANTS)}")
    parser.add_argument("--sizes", default=DEFAULT_SIZES, help="comma-separated, e.g. 1MiB,1GiB")
    parser.add_argument("--world-size", type=int, default=0, help="ranks (default: the GPU count)")
    parser.add_argument("--backend", choices=["nccl", "gloo"], default="nccl")
    parser.add_argument("--iters", type=int, default=20)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--timeout", type=float, default=600, help="seconds per variant")
    parser.add_argument("--nvml", action="store_true", help="sample every GPU during each variant")
    parser.add_argument("--out-dir", type=Path, default=ROOT / ".cache" / "nccl-bench",
                        help="where each variant's env file is written")
    parser.add_argument("--json", type=Path, help="write all results here")
    parser.add_argument("--worker", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--port", type=int, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker is not None:
        worker(args.worker, args)
        return 0
    unknown = [v for v in args.variants.split(",") if v not in VARIANTS]
    if unknown:
        parser.error(f"unknown variant(s) {unknown}; known: {', '.join(VARIANTS)}")
    report = nvml_report()
    if not args.world_size:
        args.world_size = report.get("gpu_count", 0) if args.backend == "nccl" else 2
    if args.world_size < 1:
        parser.error(f"no GPU found ({report.get('reason', 'NVML reports 0 devices')}); use --backend gloo on CPUs")
    from controller.bench import NvmlSampler

    args.out_dir.mkdir(parents=True, exist_ok=True)
    results: dict[str, dict[str, Any]] = {}
    for name in args.variants.split(","):
        policy, ib_disable = VARIANTS[name]
        rule = nccl_policy.policy_file(policy, report, ib_disable=ib_disable)
        env_file = args.out_dir / f"nccl-{name}.env"
        env_file.write_text(rule["content"])
        sampler = NvmlSampler(args.nvml)
        sampler.start()
        try:
            results[name] = run_variant(env_file, args)
        finally:
            sampler.stop()
        results[name].update(policy=policy, ib_disable=ib_disable, variables=rule["variables"],
                             reason=rule["reason"], nvml=sampler.summary())
        print(f"{name}: {rule['content'].splitlines()[0]} -> {json.dumps(rule['variables'])}", flush=True)
    first = next(iter(results.values()))
    print(f"\nall-reduce, {args.world_size} x {first['device']} ({args.backend}, torch {first['torch']}, "
          f"NCCL {first['nccl']}), {args.iters} iterations after {args.warmup} warm-up, mean per call")
    print(render(results))
    for name, result in results.items():
        print(f"{name} NVML: {json.dumps(result['nvml'])}")
    if args.json:
        args.json.write_text(json.dumps({"p2p_report": {k: report.get(k) for k in
                                                        ("p2p_supported_all_pairs", "p2p_reason", "p2p")},
                                         "variants": results}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
