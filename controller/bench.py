"""Streaming load generator for an OpenAI-compatible vLLM server.

Runs bounded load levels (closed-loop concurrency sweep, or one open-loop Poisson request rate)
against ``/v1/completions`` with ``stream: true``, ``ignore_eos: true`` and ``max_tokens`` so every
request produces exactly ``--output-len`` tokens, and reports per level:

* TTFT, TPOT, ITL and end-to-end latency (mean/p50/p95/p99, ms), defined as in ``vllm bench serve``:
  TTFT = first streamed choice chunk - send; ITL = gaps between later choice chunks;
  E2E = last choice chunk - send; TPOT = (E2E - TTFT) / (output_tokens - 1).
* request, output-token and total-token throughput; error count with the first error text.
* output tokens from the final usage chunk (``stream_options.include_usage``), never from chunk counts.
* vLLM ``/metrics`` samples: queue depth, KV-cache usage, preemptions (max/mean, counter delta).
* optional NVML samples per GPU from a thread every ~200 ms: SM utilization (GPM, Hopper and newer),
  utilization.gpu (% of time a kernel ran) and memory used.
* the harness's own CPU: getrusage(RUSAGE_SELF) CPU seconds per streamed token and % of one core.

Random prompts are built from an English word list; when the server answers ``/tokenize`` each
prompt is fitted to ``--input-len`` tokens of the *server's* tokenizer (binary search on the word
count, then single-letter top-ups), usually exact, otherwise a few tokens short. Without
``/tokenize`` the word count is a guess (1 word ~ 1.3 tokens); the tokens the server actually
prefilled are always reported from the usage chunk (``input_tokens`` in the JSON).

Exit codes: 0 every request succeeded; 1 some requests failed or the overall timeout hit;
2 usage error, or the server was unreachable (no request got an HTTP response).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import random
import resource
import sys
import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp

EXIT_OK, EXIT_FAILED_REQUESTS, EXIT_USAGE_OR_UNREACHABLE = 0, 1, 2
SCHEMA = "gptoss-bench/1"
PERCENTILES = (50, 95, 99)
# /metrics is rendered by the API server process that also streams every token: at 5 Hz it cost
# the 2-core lab server ~20 % of its c=16 throughput (bench/compare_with_vllm_bench.py, with and
# without the sampler). 1 Hz still sees queue depth and KV-cache usage move; preemptions are a counter.
DEFAULT_METRICS_INTERVAL_S = 1.0
NVML_INTERVAL_S = 0.2
# Prometheus names as exported by vLLM 0.32 (vllm/v1/metrics/loggers.py); the counter gets `_total`.
QUEUE_METRIC = "vllm:num_requests_waiting"
RUNNING_METRIC = "vllm:num_requests_running"
KV_METRICS = ("vllm:kv_cache_usage_perc", "vllm:gpu_cache_usage_perc")  # new name, pre-0.10 name
PREEMPT_METRICS = ("vllm:num_preemptions_total", "vllm:num_preemptions")
SAMPLED_PREFIXES = (QUEUE_METRIC, RUNNING_METRIC, *KV_METRICS, *PREEMPT_METRICS)

_WORD_TEXT = (
    "time year people way day man thing woman life child world school state family student group "
    "country problem hand part place case week company system program question work government "
    "number night point home water room mother area money story fact month lot right study book "
    "eye job word business issue side kind head house service friend father power hour game line "
    "end member law car city community name president team minute idea kid body information back "
    "parent face others level office door health person art war history party result change "
    "morning reason research girl guy moment air teacher force education foot boy age policy "
    "music market sense nation plan college interest death experience effect class control care "
    "field development role effort rate heart drug show leader light voice wife police mind price "
    "report decision son view relationship town road arm difference value building action model "
    "season society tax director position player record paper space ground form event official "
    "matter center couple site project activity star table need court oil situation cost industry "
    "figure street image phone data picture practice piece land product doctor wall patient worker "
    "news test movie north love support technology step baby computer type attention film tree "
    "source organization hair window evidence population site fire river glass stone bridge cloud"
)
WORDS = _WORD_TEXT.split()  # common English words: real tokenizers give ~1.3 tokens each
LETTERS = "abcdefghijklmnopqrstuvwxyz"


class UsageError(Exception):
    """Bad arguments: exit 2 with the message."""


# ---------------------------------------------------------------- prompts


@dataclass
class PromptSet:
    prompts: list[str]
    source: str  # "tokenize" (fitted to the server's tokenizer), "words" (guessed) or "file"
    target_input_len: int | None
    fitted_lens: list[int] = field(default_factory=list)  # /tokenize counts, when fitted


async def count_tokens(session: aiohttp.ClientSession, base_url: str, model: str, text: str) -> int:
    async with session.post(f"{base_url}/tokenize", json={"model": model, "prompt": text}) as resp:
        resp.raise_for_status()
        return int((await resp.json())["count"])


async def fit_prompt(
    count: Callable[[str], Any], words: list[str], target: int, rng: random.Random
) -> tuple[str, int]:
    """Longest prefix of `words` with <= target tokens, then 1-letter words to close the gap."""
    lo, hi = 1, len(words)
    best_k, best_n = 1, await count(words[0])
    while lo <= hi:
        mid = (lo + hi) // 2
        n = await count(" ".join(words[:mid]))
        if n <= target:
            best_k, best_n, lo = mid, n, mid + 1
        else:
            hi = mid - 1
    text = " ".join(words[:best_k])
    for _ in range(8):  # bounded: each top-up adds ~1 token, merges can make it 0 or 2
        if best_n >= target:
            break
        candidate = f"{text} {rng.choice(LETTERS)}"
        n = await count(candidate)
        if n <= target:
            text, best_n = candidate, n
    return text, best_n


async def build_random_prompts(
    session: aiohttp.ClientSession, base_url: str, model: str, num: int, input_len: int, seed: int
) -> PromptSet:
    rng = random.Random(seed)
    # ~2 tokens per word is plenty of headroom for real tokenizers; tiny test tokenizers need more.
    word_lists = [[rng.choice(WORDS) for _ in range(input_len * 2)] for _ in range(num)]
    try:
        await count_tokens(session, base_url, model, "hello")
    except (TimeoutError, aiohttp.ClientError, KeyError, ValueError):
        guessed = [" ".join(words[: max(1, round(input_len / 1.3))]) for words in word_lists]
        return PromptSet(guessed, "words", input_len)

    limit = asyncio.Semaphore(4)  # tokenize calls share the server; keep them few at a time

    async def count(text: str) -> int:
        async with limit:
            return await count_tokens(session, base_url, model, text)

    fitted = await asyncio.gather(
        *(fit_prompt(count, words, input_len, random.Random(seed * 7919 + i))
          for i, words in enumerate(word_lists))
    )
    return PromptSet([t for t, _ in fitted], "tokenize", input_len, [n for _, n in fitted])


def load_prompts_file(path: Path) -> list[str]:
    prompts = []
    for line_no, line in enumerate(path.read_text().splitlines(), 1):
        if not line.strip():
            continue
        try:
            prompts.append(str(json.loads(line)["prompt"]))
        except (json.JSONDecodeError, KeyError, TypeError) as exc:
            raise UsageError(f"{path}:{line_no}: expected a JSON object with a 'prompt' ({exc})") from exc
    if not prompts:
        raise UsageError(f"{path}: no prompts")
    return prompts


def write_prompts_file(path: Path, prompts: Iterable[str]) -> None:
    path.write_text("".join(json.dumps({"prompt": p}) + "\n" for p in prompts))


# ---------------------------------------------------------------- one streamed request


@dataclass
class RequestResult:
    ok: bool = False
    ttft_s: float = 0.0
    latency_s: float = 0.0
    itl_s: list[float] = field(default_factory=list)
    output_tokens: int = 0
    prompt_tokens: int = 0
    error: str = ""
    got_http_response: bool = False


TOKEN_EVENT: dict[str, Any] = {"choices": [{}]}  # what parse_sse_line returns for a plain token chunk


def parse_sse_line(line: bytes) -> dict | None:
    """One `data: {...}` event as a dict; None for blank lines, comments and [DONE].

    A token chunk without usage is not decoded: only its arrival time matters, and skipping
    json.loads on every token is a large share of the harness's CPU. Quotes inside generated text
    are escaped, so the two byte patterns below can only match the event's own keys.
    """
    if not line.startswith(b"data:"):
        return None
    payload = line[5:].strip()
    if payload == b"[DONE]" or not payload:
        return None
    if b'"choices":[{' in payload and b'"usage":{' not in payload:
        return TOKEN_EVENT
    return json.loads(payload)


async def stream_completion(
    session: aiohttp.ClientSession, url: str, model: str, prompt: str, output_len: int
) -> RequestResult:
    payload = {
        "model": model,
        "prompt": prompt,
        "max_tokens": output_len,
        "ignore_eos": True,  # vLLM extension: fixed output length, as vllm bench serve does
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    result = RequestResult()
    start = last = time.perf_counter()
    got_usage = False
    try:
        async with session.post(url, json=payload) as resp:
            result.got_http_response = True
            if resp.status != 200:
                result.error = f"HTTP {resp.status}: {(await resp.text())[:300]}"
                return result
            async for line in resp.content:
                event = parse_sse_line(line)
                if event is None:
                    continue
                if event.get("choices"):
                    now = time.perf_counter()
                    if result.ttft_s == 0.0:
                        result.ttft_s = now - start
                    else:
                        result.itl_s.append(now - last)
                    last = now
                if usage := event.get("usage"):
                    got_usage = True
                    result.output_tokens = int(usage.get("completion_tokens") or 0)
                    result.prompt_tokens = int(usage.get("prompt_tokens") or 0)
    except (TimeoutError, aiohttp.ClientError, json.JSONDecodeError, OSError) as exc:
        result.error = f"{type(exc).__name__}: {exc}"[:300]
        return result
    result.latency_s = last - start
    if result.ttft_s == 0.0:
        result.error = "stream ended without any choice chunk"
    elif not got_usage:
        result.error = "stream ended without a usage chunk (server ignored stream_options.include_usage?)"
    else:
        result.ok = True
    return result


# ---------------------------------------------------------------- samplers


def parse_prometheus(text: str, prefixes: tuple[str, ...] = ("",)) -> dict[str, float]:
    """Metric name -> value summed over label sets (one series per engine), for names with `prefixes`."""
    values: dict[str, float] = {}
    for line in text.splitlines():
        # The prefix test first: /metrics is ~50 kB and the sampler must stay cheap.
        if not line.startswith(prefixes) or line.startswith("#"):
            continue
        name_part, _, value = line.rpartition(" ")
        name = name_part.split("{", 1)[0].strip()
        try:
            values[name] = values.get(name, 0.0) + float(value)
        except ValueError:
            continue
    return values


def first_present(values: dict[str, float], names: Iterable[str]) -> tuple[str, float] | None:
    for name in names:
        if name in values:
            return name, values[name]
    return None


class MetricsSampler:
    """Polls vLLM's /metrics while a level runs, in the same event loop (its CPU is counted)."""

    def __init__(self, session: aiohttp.ClientSession, url: str | None,
                 interval_s: float = DEFAULT_METRICS_INTERVAL_S) -> None:
        self.session, self.url, self.interval_s = session, url, interval_s
        self.samples: list[dict[str, float]] = []
        self.error = ""
        self._task: asyncio.Task | None = None

    async def _poll(self) -> None:
        assert self.url
        while True:
            try:
                async with self.session.get(self.url) as resp:
                    resp.raise_for_status()
                    self.samples.append(parse_prometheus(await resp.text(), SAMPLED_PREFIXES))
            except (TimeoutError, aiohttp.ClientError) as exc:
                self.error = self.error or f"{type(exc).__name__}: {exc}"[:200]
            await asyncio.sleep(self.interval_s)

    def start(self) -> None:
        if self.url:
            self._task = asyncio.create_task(self._poll())

    async def stop(self) -> None:
        if self._task:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)

    def summary(self) -> dict[str, Any]:
        if not self.url:
            return {"status": "off"}
        if not self.samples:
            return {"status": f"no samples: {self.error or 'level ended before the first poll'}"}
        out: dict[str, Any] = {"status": "ok", "samples": len(self.samples)}
        for key, names in (("queue_depth", (QUEUE_METRIC,)), ("running", (RUNNING_METRIC,)),
                           ("kv_cache_usage_perc", KV_METRICS)):
            series = [hit for s in self.samples if (hit := first_present(s, names))]
            if series:
                vals = [v for _, v in series]
                # vLLM exports the KV usage as a 0..1 fraction despite the _perc name; we report percent.
                scale = 100.0 if key == "kv_cache_usage_perc" else 1.0
                mean = sum(vals) / len(vals)
                out[key] = {"metric": series[0][0], "max": max(vals) * scale, "mean": mean * scale}
        preempt = [hit for s in self.samples if (hit := first_present(s, PREEMPT_METRICS))]
        if preempt:
            out["preemptions"] = {"metric": preempt[0][0], "delta": preempt[-1][1] - preempt[0][1]}
        return out


class GpmSmUtil:
    """True SM utilization (% of SMs busy) from NVML's GPU Performance Monitoring, between two
    samples of one GPU. GPM exists on Hopper and newer only; elsewhere (Ada: the 4090D) `supported`
    is False and only NVML's utilization.gpu is reported, which is the % of time *any* kernel ran,
    an upper bound of SM utilization."""

    def __init__(self, nvml: Any, handle: Any) -> None:
        self.nvml, self.handle, self.supported, self.reason = nvml, handle, False, ""
        self._samples: list[Any] = []
        self._have_previous = False
        try:
            if not nvml.nvmlGpmQueryDeviceSupport(handle).isSupportedDevice:
                self.reason = "GPM not supported by this GPU (Hopper or newer)"
                return
            self._samples = [nvml.nvmlGpmSampleAlloc(), nvml.nvmlGpmSampleAlloc()]
        except Exception as exc:  # old driver/NVML without GPM: NVMLError_FunctionNotFound etc.
            self.reason = f"GPM unavailable ({type(exc).__name__})"
            return
        self.supported = True

    def sample(self) -> float | None:
        """SM % since the previous call (None on the first call or when unsupported)."""
        if not self.supported:
            return None
        previous, current = self._samples
        self.nvml.nvmlGpmSampleGet(self.handle, current)
        value = None
        if self._have_previous:
            request = self.nvml.c_nvmlGpmMetricsGet_t()
            request.version = self.nvml.NVML_GPM_METRICS_GET_VERSION
            request.numMetrics = 1
            request.sample1, request.sample2 = previous, current
            request.metrics[0].metricId = self.nvml.NVML_GPM_METRIC_SM_UTIL
            self.nvml.nvmlGpmMetricsGet(request)
            if request.metrics[0].nvmlReturn == self.nvml.NVML_SUCCESS:
                value = float(request.metrics[0].value)
        self._samples = [current, previous]
        self._have_previous = True
        return value

    def baseline(self) -> None:
        """Take the sample the next interval is measured from (at the start of each level)."""
        self._have_previous = False
        self.sample()


class NvmlSampler:
    """Per GPU: SM utilization (GPM, where the GPU has it), NVML utilization.gpu and memory used,
    sampled from a thread (NVML calls block)."""

    def __init__(self, enabled: bool) -> None:
        self.status = "off (--nvml not given)"
        # per sample, per GPU: (utilization.gpu %, GPM SM % or None, memory used bytes)
        self.samples: list[list[tuple[int, float | None, int]]] = []
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._nvml: Any = None
        self._handles: list[Any] = []
        self._gpm: list[GpmSmUtil] = []
        if enabled:
            self._init()

    def _init(self) -> None:
        try:
            import pynvml

            pynvml.nvmlInit()
            count = pynvml.nvmlDeviceGetCount()
            self._handles = [pynvml.nvmlDeviceGetHandleByIndex(i) for i in range(count)]
        except Exception as exc:  # ImportError, NVMLError_LibraryNotFound, driver errors: all mean "no GPU"
            self.status = f"no GPU: skipped ({type(exc).__name__}: {exc})"[:200]
            return
        if not self._handles:
            self.status = "no GPU: skipped (NVML reports 0 devices)"
            return
        self._nvml, self.status = pynvml, "ok"
        self._gpm = [GpmSmUtil(pynvml, handle) for handle in self._handles]

    def _run(self) -> None:
        for gpm in self._gpm:
            gpm.baseline()
        while not self._stop.wait(NVML_INTERVAL_S):
            row = []
            for handle, gpm in zip(self._handles, self._gpm, strict=True):
                util = self._nvml.nvmlDeviceGetUtilizationRates(handle).gpu
                row.append((int(util), gpm.sample(), int(self._nvml.nvmlDeviceGetMemoryInfo(handle).used)))
            self.samples.append(row)

    def start(self) -> None:
        if self._nvml:
            self.samples, self._stop = [], threading.Event()
            self._thread = threading.Thread(target=self._run, name="nvml-sampler", daemon=True)
            self._thread.start()

    def stop(self) -> None:
        if self._thread:
            self._stop.set()
            self._thread.join()
            self._thread = None

    def summary(self) -> dict[str, Any]:
        if self.status != "ok":
            return {"status": self.status}
        gpus = []
        for idx, gpm in enumerate(self._gpm):
            utils = [row[idx][0] for row in self.samples]
            sms = [row[idx][1] for row in self.samples if row[idx][1] is not None]
            mems = [row[idx][2] for row in self.samples]
            gpu: dict[str, Any] = {
                "index": idx,
                "gpu_util_pct": {"max": max(utils, default=0), "mean": sum(utils) / len(utils) if utils else 0.0},
                "mem_used_mib": {"max": max(mems, default=0) / 2**20},
            }
            if sms:
                gpu["sm_util_pct"] = {"source": "GPM SM_UTIL", "max": max(sms), "mean": sum(sms) / len(sms)}
            else:
                gpu["sm_util_pct"] = {"source": "unavailable", "reason": gpm.reason or "no GPM samples"}
            gpus.append(gpu)
        return {"status": "ok", "samples": len(self.samples), "gpus": gpus}


# ---------------------------------------------------------------- statistics


def percentile(sorted_vals: list[float], pct: float) -> float:
    """Linear interpolation between closest ranks, same as numpy.percentile's default."""
    if not sorted_vals:
        return 0.0
    rank = (len(sorted_vals) - 1) * pct / 100.0
    lo, hi = math.floor(rank), math.ceil(rank)
    return sorted_vals[lo] + (sorted_vals[hi] - sorted_vals[lo]) * (rank - lo)


def distribution_ms(values_s: list[float]) -> dict[str, float]:
    vals = sorted(v * 1000.0 for v in values_s)
    out = {"mean": sum(vals) / len(vals) if vals else 0.0}
    out.update({f"p{p}": percentile(vals, p) for p in PERCENTILES})
    return out


def cpu_seconds() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def level_metrics(results: list[RequestResult], duration_s: float) -> dict[str, Any]:
    done = [r for r in results if r.ok]
    failed = [r for r in results if not r.ok]
    out_tokens = sum(r.output_tokens for r in done)
    in_tokens = sum(r.prompt_tokens for r in done)
    tpots = [(r.latency_s - r.ttft_s) / (r.output_tokens - 1) for r in done if r.output_tokens > 1]
    return {
        "completed": len(done),
        "errors": len(failed),
        "first_error": failed[0].error if failed else "",
        "duration_s": duration_s,
        "input_tokens": in_tokens,
        "output_tokens": out_tokens,
        "request_throughput": len(done) / duration_s if duration_s else 0.0,
        "output_throughput": out_tokens / duration_s if duration_s else 0.0,
        "total_token_throughput": (in_tokens + out_tokens) / duration_s if duration_s else 0.0,
        "ttft_ms": distribution_ms([r.ttft_s for r in done]),
        "tpot_ms": distribution_ms(tpots),
        "itl_ms": distribution_ms([gap for r in done for gap in r.itl_s]),
        "e2el_ms": distribution_ms([r.latency_s for r in done]),
    }


# ---------------------------------------------------------------- load levels


@dataclass
class LevelSpec:
    concurrency: int | None  # closed loop: at most this many requests in flight
    request_rate: float | None  # open loop: Poisson arrivals at this mean rate (req/s)

    @property
    def label(self) -> str:
        return f"c={self.concurrency}" if self.concurrency else f"rate={self.request_rate:g}/s"


async def send_level(
    spec: LevelSpec, prompts: list[str], send: Callable[[str], Any], rng: random.Random, deadline: float
) -> tuple[list[RequestResult], bool]:
    """Run every prompt once under the level's load shape; returns results and whether time ran out."""
    limit = asyncio.Semaphore(spec.concurrency or len(prompts))

    async def one(prompt: str) -> RequestResult:
        async with limit:
            return await send(prompt)

    tasks: list[asyncio.Task] = []
    for prompt in prompts:
        tasks.append(asyncio.create_task(one(prompt)))
        if spec.request_rate:
            await asyncio.sleep(rng.expovariate(spec.request_rate))
    done, pending = await asyncio.wait(tasks, timeout=max(0.0, deadline - time.monotonic()))
    for task in pending:
        task.cancel()
    await asyncio.gather(*pending, return_exceptions=True)
    results = [t.result() if t in done else RequestResult(error="overall --timeout reached") for t in tasks]
    return results, bool(pending)


async def run_level(
    spec: LevelSpec, prompts: list[str], send: Callable[[str], Any], session: aiohttp.ClientSession,
    metrics_url: str | None, nvml: NvmlSampler, seed: int, deadline: float,
    metrics_interval_s: float = DEFAULT_METRICS_INTERVAL_S,
) -> dict[str, Any]:
    sampler = MetricsSampler(session, metrics_url, metrics_interval_s)
    sampler.start()
    nvml.start()
    cpu0, wall0 = cpu_seconds(), time.perf_counter()
    results, timed_out = await send_level(spec, prompts, send, random.Random(seed), deadline)
    wall, cpu = time.perf_counter() - wall0, cpu_seconds() - cpu0
    nvml.stop()
    await sampler.stop()
    metrics = level_metrics(results, wall)
    streamed = sum(r.output_tokens for r in results)
    return {
        "label": spec.label,
        "concurrency": spec.concurrency,
        "request_rate": spec.request_rate,
        "num_prompts": len(prompts),
        **metrics,
        "timed_out": timed_out,
        "unreachable": all(not r.got_http_response for r in results),
        "server_metrics": sampler.summary(),
        "nvml": nvml.summary(),
        "harness": {
            "cpu_s": cpu,
            "wall_s": wall,
            "cpu_pct_one_core": 100.0 * cpu / wall if wall else 0.0,
            "us_per_token": 1e6 * cpu / streamed if streamed else None,
        },
    }


def auth_headers(api_key_env: str | None) -> dict[str, str]:
    if not api_key_env:
        return {}
    key = os.environ.get(api_key_env)
    if not key:
        raise UsageError(f"--api-key-env {api_key_env}: variable is not set or empty")
    return {"Authorization": f"Bearer {key}"}


async def prepare_prompts(args: argparse.Namespace, session: aiohttp.ClientSession, total: int) -> PromptSet:
    if args.prompts_file:
        base = load_prompts_file(Path(args.prompts_file))
        # Reuse the file cyclically when it is shorter than the run needs.
        return PromptSet([base[i % len(base)] for i in range(total)], "file", None)
    return await build_random_prompts(session, args.base_url, args.model, total, args.input_len, args.seed)


async def run_benchmark(args: argparse.Namespace) -> dict[str, Any]:
    headers = auth_headers(args.api_key_env)
    specs = level_specs(args)
    deadline = time.monotonic() + args.timeout
    timeout = aiohttp.ClientTimeout(total=args.request_timeout, sock_connect=10)
    # limit=0: the client never queues requests behind its own connection pool.
    connector = aiohttp.TCPConnector(limit=0)
    async with aiohttp.ClientSession(timeout=timeout, connector=connector, headers=headers) as session:
        cpu0 = cpu_seconds()
        prompt_set = await prepare_prompts(args, session, args.num_prompts * len(specs) + args.warmup)
        prompt_cpu = cpu_seconds() - cpu0
        url = f"{args.base_url}/v1/completions"

        async def send(prompt: str) -> RequestResult:
            return await stream_completion(session, url, args.model, prompt, args.output_len)

        warmups = prompt_set.prompts[: args.warmup]
        await asyncio.gather(*(send(p) for p in warmups))
        nvml = NvmlSampler(args.nvml)
        levels = []
        for i, spec in enumerate(specs):
            start = args.warmup + i * args.num_prompts
            # Fresh prompts per level so prefix caching never serves one level from another's work.
            prompts = prompt_set.prompts[start : start + args.num_prompts]
            level = await run_level(spec, prompts, send, session, args.metrics_url, nvml, args.seed, deadline,
                                    args.metrics_interval)
            levels.append(level)
            if time.monotonic() >= deadline:
                break
    return build_report(args, prompt_set, prompt_cpu, levels)


def build_report(args: argparse.Namespace, prompt_set: PromptSet, prompt_cpu: float,
                 levels: list[dict[str, Any]]) -> dict[str, Any]:
    measured_inputs = [lvl["input_tokens"] / lvl["completed"] for lvl in levels if lvl["completed"]]
    fitted = prompt_set.fitted_lens
    cpu = sum(lvl["harness"]["cpu_s"] for lvl in levels)
    wall = sum(lvl["harness"]["wall_s"] for lvl in levels)
    tokens = sum(lvl["output_tokens"] for lvl in levels)
    return {
        "schema": SCHEMA,
        "label": args.label,
        "config": {
            "base_url": args.base_url, "model": args.model, "input_len": args.input_len,
            "output_len": args.output_len, "num_prompts": args.num_prompts, "seed": args.seed,
            "warmup": args.warmup, "prompts_file": args.prompts_file, "metrics_url": args.metrics_url,
            "metrics_interval_s": args.metrics_interval,
        },
        "prompts": {
            "source": prompt_set.source,
            "target_input_len": prompt_set.target_input_len,
            "fitted_tokens": {"min": min(fitted), "max": max(fitted), "mean": sum(fitted) / len(fitted)}
            if fitted else None,
            "server_input_tokens_mean": sum(measured_inputs) / len(measured_inputs)
            if measured_inputs else None,
            "build_cpu_s": prompt_cpu,
        },
        "levels": levels,
        "harness_total": {
            "cpu_s": cpu, "wall_s": wall, "output_tokens": tokens,
            "cpu_pct_one_core": 100.0 * cpu / wall if wall else 0.0,
            "us_per_token": 1e6 * cpu / tokens if tokens else None,
        },
    }


def exit_code(report: dict[str, Any]) -> int:
    levels = report["levels"]
    if levels and all(lvl["unreachable"] for lvl in levels):
        return EXIT_USAGE_OR_UNREACHABLE
    if any(lvl["errors"] or lvl["timed_out"] for lvl in levels):
        return EXIT_FAILED_REQUESTS
    return EXIT_OK


# ---------------------------------------------------------------- output


def fmt(value: Any, digits: int = 1) -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        return f"{value:.{digits}f}"
    return str(value)


def render_table(headers: list[str], rows: list[list[str]]) -> str:
    widths = [max(len(h), *(len(r[i]) for r in rows)) for i, h in enumerate(headers)]
    lines = ["  ".join(h.rjust(w) for h, w in zip(headers, widths, strict=True))]
    lines.append("  ".join("-" * w for w in widths))
    lines += ["  ".join(c.rjust(w) for c, w in zip(r, widths, strict=True)) for r in rows]
    return "\n".join(lines)


def dist_cells(dist: dict[str, float]) -> list[str]:
    return [fmt(dist[f"p{p}"]) for p in PERCENTILES]


def render_report(report: dict[str, Any]) -> str:
    levels = report["levels"]
    lat_headers = ["level", "ok", "err", "req/s", "out tok/s", "tot tok/s"]
    for metric in ("TTFT", "TPOT", "ITL", "E2E"):
        lat_headers += [f"{metric} p{p}" for p in PERCENTILES]
    lat_rows = []
    for lvl in levels:
        row = [lvl["label"], str(lvl["completed"]), str(lvl["errors"]), fmt(lvl["request_throughput"], 2),
               fmt(lvl["output_throughput"]), fmt(lvl["total_token_throughput"])]
        for key in ("ttft_ms", "tpot_ms", "itl_ms", "e2el_ms"):
            row += dist_cells(lvl[key])
        lat_rows.append(row)
    side_rows = [side_row(lvl) for lvl in levels]
    side_headers = ["level", "queue max", "queue mean", "kv% max", "kv% mean", "preempt",
                    "harness cpu%", "harness us/tok", "gpu"]
    prompts = report["prompts"]
    notes = [f"latencies in ms; prompts: {prompts['source']}, target {prompts['target_input_len']} tokens, "
             f"server-measured mean {fmt(prompts['server_input_tokens_mean'])}"]
    notes += [f"{lvl['label']}: first error: {lvl['first_error']}" for lvl in levels if lvl["errors"]]
    return "\n\n".join([render_table(lat_headers, lat_rows), render_table(side_headers, side_rows), *notes])


def side_row(lvl: dict[str, Any]) -> list[str]:
    sm = lvl["server_metrics"]
    queue, kv = sm.get("queue_depth", {}), sm.get("kv_cache_usage_perc", {})
    nvml = lvl["nvml"]
    gpu = nvml["status"] if nvml["status"] != "ok" else " ".join(
        f"gpu{g['index']}:" + (f"SM {g['sm_util_pct']['mean']:.0f}% " if "mean" in g["sm_util_pct"] else "")
        + f"busy {g['gpu_util_pct']['mean']:.0f}%/{g['mem_used_mib']['max']:.0f}MiB"
        for g in nvml["gpus"])
    return [lvl["label"], fmt(queue.get("max"), 0), fmt(queue.get("mean")), fmt(kv.get("max"), 3),
            fmt(kv.get("mean"), 3), fmt(sm.get("preemptions", {}).get("delta"), 0),
            fmt(lvl["harness"]["cpu_pct_one_core"]), fmt(lvl["harness"]["us_per_token"]), gpu]


def write_plot(report: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")  # headless: no display on hosts or CI
    import matplotlib.pyplot as plt

    levels = [lvl for lvl in report["levels"] if lvl["completed"]]
    xs = [lvl["concurrency"] or lvl["request_rate"] for lvl in levels]
    xlabel = "concurrency (streams)" if levels and levels[0]["concurrency"] else "request rate (req/s)"
    fig, (ax_lat, ax_tput) = plt.subplots(1, 2, figsize=(12, 4.5))
    for key, name in (("ttft_ms", "TTFT"), ("e2el_ms", "E2E")):
        for pct, style in (("p50", "-o"), ("p95", "--s")):
            ax_lat.plot(xs, [lvl[key][pct] for lvl in levels], style, label=f"{name} {pct}")
    ax_lat.set(xlabel=xlabel, ylabel="latency (ms)", title="Latency")
    ax_tput.plot(xs, [lvl["output_throughput"] for lvl in levels], "-o", label="output tok/s")
    ax_tput.plot(xs, [lvl["total_token_throughput"] for lvl in levels], "--s", label="total tok/s")
    ax_tput.set(xlabel=xlabel, ylabel="tokens/s", title="Token throughput")
    for ax in (ax_lat, ax_tput):
        ax.grid(True, alpha=0.3)
        ax.legend()
        if len(xs) > 1 and min(xs) > 0:
            ax.set_xscale("log", base=2)
    fig.suptitle(f"{report.get('label') or report['config']['model']}: in {report['config']['input_len']} / "
                 f"out {report['config']['output_len']} tokens")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


# ---------------------------------------------------------------- --compare


COMPARE_ROWS = (
    ("req/s", ("request_throughput",)),
    ("out tok/s", ("output_throughput",)),
    ("total tok/s", ("total_token_throughput",)),
    ("TTFT p50 ms", ("ttft_ms", "p50")),
    ("TTFT p95 ms", ("ttft_ms", "p95")),
    ("TPOT p50 ms", ("tpot_ms", "p50")),
    ("ITL p95 ms", ("itl_ms", "p95")),
    ("E2E p50 ms", ("e2el_ms", "p50")),
    ("E2E p95 ms", ("e2el_ms", "p95")),
    ("errors", ("errors",)),
    ("harness cpu%", ("harness", "cpu_pct_one_core")),
)


def lookup(level: dict[str, Any], path: tuple[str, ...]) -> float:
    value: Any = level
    for key in path:
        value = value[key]
    return float(value)


def ratio(a: float, b: float) -> float | None:
    return b / a if a else None


def load_report(path: Path) -> dict[str, Any]:
    try:
        report = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise UsageError(f"{path}: {exc}") from exc
    if report.get("schema") != SCHEMA:
        raise UsageError(f"{path}: not a controller.bench result (schema {report.get('schema')!r})")
    return report


def render_compare(path_a: Path, path_b: Path) -> str:
    a, b = load_report(path_a), load_report(path_b)
    name_a, name_b = a.get("label") or path_a.stem, b.get("label") or path_b.stem
    levels_b = {lvl["label"]: lvl for lvl in b["levels"]}
    common = [lvl for lvl in a["levels"] if lvl["label"] in levels_b]
    if not common:
        raise UsageError(f"no common load level: {path_a} and {path_b} share no concurrency/rate")
    out = [f"{name_a} vs {name_b}  (ratio = {name_b}/{name_a})"]
    for lvl_a in common:
        lvl_b = levels_b[lvl_a["label"]]
        rows = []
        for title, key_path in COMPARE_ROWS:
            va, vb = lookup(lvl_a, key_path), lookup(lvl_b, key_path)
            rows.append([title, fmt(va, 2), fmt(vb, 2), fmt(ratio(va, vb), 3)])
        out.append(render_table([lvl_a["label"], name_a, name_b, f"{name_b}/{name_a}"], rows))
    return "\n\n".join(out)


# ---------------------------------------------------------------- CLI


def parse_levels(text: str) -> list[int]:
    try:
        levels = [int(x) for x in text.split(",") if x.strip()]
    except ValueError as exc:
        raise UsageError(f"--concurrency {text!r}: expected comma-separated integers") from exc
    if not levels or min(levels) < 1:
        raise UsageError(f"--concurrency {text!r}: every level must be >= 1")
    return levels


def level_specs(args: argparse.Namespace) -> list[LevelSpec]:
    if args.request_rate is not None:
        if args.request_rate <= 0:
            raise UsageError("--request-rate must be > 0")
        return [LevelSpec(None, args.request_rate)]
    return [LevelSpec(c, None) for c in parse_levels(args.concurrency)]


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m controller.bench",
        description=__doc__,
        epilog="Exit codes: 0 all requests ok; 1 some requests failed or --timeout hit; "
               "2 usage error or server unreachable. "
               "Compare: python -m controller.bench --compare A.json B.json",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--compare", nargs=2, metavar=("A.json", "B.json"),
                        help="print two result files side by side with B/A ratios, then exit")
    parser.add_argument("--base-url",
                        help="server root, e.g. http://127.0.0.1:8000 (a trailing /v1 is dropped)")
    parser.add_argument("--model", help="served model name sent in each request")
    parser.add_argument("--api-key-env", metavar="VAR", help="environment variable holding the API key")
    load = parser.add_mutually_exclusive_group()
    load.add_argument("--concurrency", default="1,2,4,8,16",
                      help="closed-loop levels, comma separated (default %(default)s)")
    load.add_argument("--request-rate", type=float, help="open loop: one level of Poisson arrivals (req/s)")
    parser.add_argument("--num-prompts", type=int, default=64,
                        help="requests per level (default %(default)s)")
    parser.add_argument("--input-len", type=int, default=512,
                        help="prompt length in tokens (random prompts) (default %(default)s)")
    parser.add_argument("--output-len", type=int, default=128,
                        help="output tokens per request (ignore_eos) (default %(default)s)")
    parser.add_argument("--prompts-file", help="jsonl with a 'prompt' per line instead of random prompts")
    parser.add_argument("--seed", type=int, default=0, help="prompt generator seed (default %(default)s)")
    parser.add_argument("--warmup", type=int, default=0,
                        help="untimed requests sent before the first level (default %(default)s)")
    parser.add_argument("--label", help="name of this run in --compare output (default: file name)")
    parser.add_argument("--json", metavar="OUT.json", help="write the full result here")
    parser.add_argument("--plot", metavar="OUT.png", help="latency and throughput vs load")
    parser.add_argument("--metrics-url",
                        help="vLLM Prometheus endpoint (default BASE/metrics; 'none' disables)")
    parser.add_argument("--metrics-interval", type=float, default=DEFAULT_METRICS_INTERVAL_S, metavar="S",
                        help="seconds between /metrics samples; each one costs the server's API process CPU "
                             "(default %(default)s)")
    parser.add_argument("--nvml", action="store_true",
                        help="sample GPU SM utilization (NVML GPM, Hopper+), NVML utilization.gpu and memory")
    parser.add_argument("--timeout", type=float, default=1800.0,
                        help="overall limit for all levels (s) (default %(default)s)")
    parser.add_argument("--request-timeout", type=float, default=600.0,
                        help="limit per request (s) (default %(default)s)")
    return parser


def validate(args: argparse.Namespace) -> None:
    if not args.base_url or not args.model:
        raise UsageError("--base-url and --model are required (or use --compare A.json B.json)")
    args.base_url = args.base_url.rstrip("/").removesuffix("/v1")
    if not args.base_url.startswith(("http://", "https://")):
        raise UsageError(f"--base-url {args.base_url!r}: expected http:// or https://")
    for name in ("num_prompts", "input_len", "output_len", "timeout", "request_timeout", "metrics_interval"):
        if getattr(args, name) <= 0:
            raise UsageError(f"--{name.replace('_', '-')} must be > 0")
    if args.warmup < 0:
        raise UsageError("--warmup must be >= 0")
    if args.metrics_url is None:
        args.metrics_url = f"{args.base_url}/metrics"
    elif args.metrics_url.lower() == "none":
        args.metrics_url = None
    level_specs(args)


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        if args.compare:
            print(render_compare(Path(args.compare[0]), Path(args.compare[1])))
            return EXIT_OK
        validate(args)
        report = asyncio.run(run_benchmark(args))
    except UsageError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return EXIT_USAGE_OR_UNREACHABLE
    code = exit_code(report)
    report["exit_code"] = code
    print(render_report(report))
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=2) + "\n")
    if args.plot:
        write_plot(report, Path(args.plot))
    if code == EXIT_USAGE_OR_UNREACHABLE:
        print(f"error: {args.base_url} unreachable: {report['levels'][0]['first_error']}", file=sys.stderr)
    return code


if __name__ == "__main__":
    sys.exit(main())
