"""Filter gptoss.host.merge_profile_flags: module_utils/profile_flags.merge_flags for the roles' YAML."""

from __future__ import annotations

from ansible.errors import AnsibleFilterError
from ansible_collections.gptoss.host.plugins.module_utils.profile_flags import ProfileFlagsError, merge_flags


def merge_profile_flags(profile_flags, override=None):
    try:
        return merge_flags(profile_flags, override)
    except ProfileFlagsError as exc:
        raise AnsibleFilterError(str(exc)) from None


class FilterModule:
    def filters(self):
        return {"merge_profile_flags": merge_profile_flags}
