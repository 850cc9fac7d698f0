"""How a profile's vLLM flags and the user's override make the flags a server gets: the one home.

Called on the controller by the ``gptoss.host.merge_profile_flags`` filter, which the vllm_service
role's rollout and its preflight input both use; ``service.venv.vllm_flags`` then renders and
validates what this returns. Standard library only.
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


def merge_flags(profile_flags: Mapping[str, Any] | None, override: Mapping[str, Any] | None) -> dict[str, Any]:
    """The profile's flags with the override applied: an override value replaces the profile's (a whole
    value, never merged into it), an override of null removes the flag, new names are added after the
    profile's. Order is kept (vLLM reads a flag given twice as its last value; we give each once)."""
    for name, flags in (("profile flags", profile_flags), ("vllm_service_flags_override", override)):
        if flags is not None and not isinstance(flags, Mapping):
            raise ProfileFlagsError(f"{name} must be a mapping of flag name -> value, got {_kind(flags)}")
    merged = dict(profile_flags or {})
    merged.update(override or {})
    return {name: value for name, value in merged.items() if value is not None}
