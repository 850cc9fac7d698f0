"""How a profile's vLLM flags and the user's override make the flags a server gets: the one home.

Called on the controller by the ``gptoss.host.profile_flags`` filter, which the vllm_service role's
rollout, its validation and its preflight input use (vars/main.yml); ``service.venv.vllm_flags`` then
renders and validates what this returns. Standard library only.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any


class ProfileFlagsError(ValueError):
    """Flags that are not a mapping of flag name -> value."""


def _kind(value: Any) -> str:
    # Ansible hands lazy container types over; name what the user wrote instead.
    if isinstance(value, str):
        return "str"
    return "list" if isinstance(value, Sequence) else type(value).__name__


def _apply(layers: list[tuple[str, Mapping[str, Any] | None]]) -> dict[str, Any]:
    for name, flags in layers:
        if flags is not None and not isinstance(flags, Mapping):
            raise ProfileFlagsError(f"{name} must be a mapping of flag name -> value, got {_kind(flags)}")
    merged: dict[str, Any] = {}
    for _name, flags in layers:
        merged.update(flags or {})
    return {name: value for name, value in merged.items() if value is not None}


def merge_flags(profile_flags: Mapping[str, Any] | None, override: Mapping[str, Any] | None) -> dict[str, Any]:
    """The profile's flags with the override applied: an override value replaces the profile's (a whole
    value, never merged into it), an override of null removes the flag, new names are added after the
    profile's. Order is kept (vLLM reads a flag given twice as its last value; we give each once)."""
    return _apply([("profile flags", profile_flags), ("vllm_service_flags_override", override)])


def profile_flags(profile: Mapping[str, Any], override: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """The flags a server of `profile` (an entry of vllm_service_profiles) gets: its base_flags (the
    shared flags it names, if any), its own flags applied to them, then the override, each by the rule of
    merge_flags. A null in the base is a placeholder that keeps a flag's place in the order."""
    if not isinstance(profile, Mapping):
        raise ProfileFlagsError(f"a profile must be a mapping with flags, got {_kind(profile)}")
    return _apply([("the profile's base_flags", profile.get("base_flags")),
                   ("the profile's flags", profile.get("flags")),
                   ("vllm_service_flags_override", override)])
