"""Filter gptoss.host.profile_flags: module_utils/profile_flags.profile_flags for the roles' YAML."""

from __future__ import annotations

from ansible.errors import AnsibleFilterError
from ansible_collections.gptoss.host.plugins.module_utils.profile_flags import ProfileFlagsError
from ansible_collections.gptoss.host.plugins.module_utils.profile_flags import profile_flags as _profile_flags


def profile_flags(profile, override=None):
    try:
        return _profile_flags(profile, override)
    except ProfileFlagsError as exc:
        raise AnsibleFilterError(str(exc)) from None


class FilterModule:
    def filters(self):
        return {"profile_flags": profile_flags}
