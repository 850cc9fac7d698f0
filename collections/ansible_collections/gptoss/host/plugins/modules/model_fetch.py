#!/usr/bin/python
"""Ansible module: fetch a model (or any file set) into a folder, verified, resumable and atomic."""

from __future__ import annotations

DOCUMENTATION = r"""
---
module: model_fetch
short_description: Download a pinned file set into a folder, verify every file, switch it in atomically
description:
  - Sources are C(mirror) (plain HTTP(S) or file:// URL plus a JSON manifest with size and sha256
    per file), C(hf) (the Hugging Face hub or any endpoint speaking its API, through the official
    huggingface_hub client) and C(modelscope) (its official client). The hub clients must be
    importable by the python that runs this module.
  - The bytes still missing must fit the target's file system (plus a margin); this is checked
    before anything is downloaded.
  - Files are fetched into a staging folder next to I(dest) and resumed from where a killed run
    stopped (an HTTP Range request, for mirrors and hf; a server that ignores Range sends the
    file again). Every file is checked by sha256 (the manifest's, or the hub's LFS sha256; the
    hub's git blob id for small non-LFS files); one wrong byte refuses the whole set and I(dest)
    is not touched.
  - The staging folder replaces I(dest) in one rename exchange, so I(dest) is never half-replaced.
  - With I(time_budget_s) the module returns after about that many seconds of downloading with
    C(done=false); the action plugin of the same name calls it again and prints progress on the
    controller in between.
options:
  dest: {description: Folder to fill (replaced as a whole)., type: path, required: true}
  source: {description: Where the files come from., type: str, required: true, choices: [mirror, hf, modelscope]}
  manifest_url:
    description: "mirror: URL of the manifest JSON ({revision, files: [{path, size, sha256}]})."
    type: str
  base_url: {description: "mirror: URL the manifest's paths are relative to; default the manifest's folder.", type: str}
  repo_id: {description: "hf/modelscope: repository id, e.g. openai/gpt-oss-20b.", type: str}
  revision: {description: "hf/modelscope: the commit to pin (40 hex digits).", type: str}
  endpoint: {description: "hf: the hub endpoint (HF_ENDPOINT), e.g. a mirror. Empty: the client's default.", type: str}
  token: {description: "hf/modelscope: access token (from the vault).", type: str, no_log: true}
  time_budget_s:
    description: Return after about this many seconds of downloading (0 = run to the end).
    type: int
    default: 0
author: gptoss-host
"""

EXAMPLES = r"""
- name: gpt-oss-20b from a mirror
  gptoss.host.model_fetch:
    dest: /models/gpt-oss-20b
    source: mirror
    manifest_url: https://mirror.example/gpt-oss-20b/manifest.json
"""

RETURN = r"""
done: {description: False when the time budget ran out first (call again to go on)., type: bool, returned: always}
revision: {description: The pinned revision now live (or to be)., type: str, returned: always}
bytes_total: {description: Size of the whole file set., type: int, returned: always}
bytes_missing: {description: Bytes still to download at the start of this call., type: int, returned: always}
progress: {description: One line for humans., type: str, returned: always}
"""

import json
import time
from pathlib import Path

from ansible.module_utils.basic import AnsibleModule
from ansible_collections.gptoss.host.plugins.module_utils import model_fetch as mf


def file_list(params: dict) -> tuple[str, list[mf.FileSpec], str]:
    """(revision, files, base_url) for the configured source."""
    source = params["source"]
    if source == "mirror":
        if not params["manifest_url"]:
            raise mf.FetchError("source mirror needs manifest_url")
        try:
            data = json.loads(mf.read_url(params["manifest_url"]))
        except (OSError, ValueError) as err:
            raise mf.FetchError(f"manifest {params['manifest_url']}: {err}") from err
        revision, files = mf.parse_manifest(data)
        base_url = params["base_url"] or params["manifest_url"].rsplit("/", 1)[0]
        return revision, files, base_url
    if not params["repo_id"] or not params["revision"]:
        raise mf.FetchError(f"source {source} needs repo_id and revision")
    mf.require_commit(params["revision"])
    try:
        if source == "hf":
            files = mf.hf_file_list(params["repo_id"], params["revision"], params["endpoint"], params["token"])
        else:
            files = mf.modelscope_file_list(params["repo_id"], params["revision"], params["token"])
    except ImportError as err:
        raise mf.FetchError(f"source {source}: its client library is not importable here ({err})") from err
    return params["revision"], files, ""


def fetch(params: dict, staging: Path, files: list[mf.FileSpec], base_url: str, deadline: float | None) -> bool:
    if params["source"] == "mirror":
        return mf.fetch_to_staging(base_url, staging, files, deadline=deadline)
    staging.mkdir(parents=True, exist_ok=True)
    for spec in files:
        if (staging / spec.path).is_file() and not mf.verify_file(staging / spec.path, spec):
            continue
        if params["source"] == "hf":
            mf.hf_download(params["repo_id"], params["revision"], spec, staging, params["endpoint"], params["token"])
        else:
            mf.modelscope_download(params["repo_id"], params["revision"], spec, staging)
        if deadline is not None and time.monotonic() > deadline:
            return False
    mf.clean_client_state(staging)
    return True


def run(module: AnsibleModule) -> dict:
    params = module.params
    dest = Path(params["dest"])
    revision, files, base_url = file_list(params)
    ident = mf.manifest_id(revision, files)
    total = sum(f.size for f in files)
    before = mf.read_marker(dest).get("revision", "")
    result = {"done": True, "revision": revision, "bytes_total": total, "bytes_missing": 0,
              "diff": {"before": f"revision: {before or '(none)'}\n", "after": f"revision: {revision}\n"}}
    if mf.is_current(dest, ident, files):
        return {**result, "changed": False, "progress": f"{dest}: revision {revision} already in place"}
    dest.parent.mkdir(parents=True, exist_ok=True)
    staging = mf.staging_dir_for(dest, ident)
    missing = mf.bytes_to_fetch(staging, files)
    mf.check_free_space(dest.parent, missing)
    result["bytes_missing"] = missing
    if module.check_mode:
        return {**result, "changed": True, "progress": f"{dest}: would fetch {mf.human(missing)} of {mf.human(total)}"}
    budget = params["time_budget_s"]
    deadline = time.monotonic() + budget if budget > 0 else None
    if not fetch(params, staging, files, base_url, deadline):
        left = mf.bytes_to_fetch(staging, files)
        done_pct = 100 * (total - left) // max(total, 1)
        return {**result, "changed": True, "done": False,
                "progress": f"{dest}: {mf.human(total - left)} of {mf.human(total)} ({done_pct} %)"}
    mf.verify_folder(staging, files)
    mf.switch_in(staging, dest, ident, revision)
    return {**result, "changed": True, "progress": f"{dest}: revision {revision} in place ({mf.human(total)})"}


def main() -> None:
    module = AnsibleModule(
        argument_spec={
            "dest": {"type": "path", "required": True},
            "source": {"type": "str", "required": True, "choices": ["mirror", "hf", "modelscope"]},
            "manifest_url": {"type": "str", "default": ""},
            "base_url": {"type": "str", "default": ""},
            "repo_id": {"type": "str", "default": ""},
            "revision": {"type": "str", "default": ""},
            "endpoint": {"type": "str", "default": ""},
            "token": {"type": "str", "default": "", "no_log": True},
            "time_budget_s": {"type": "int", "default": 0},
        },
        supports_check_mode=True,
    )
    try:
        module.exit_json(**run(module))
    except mf.FetchError as err:
        module.fail_json(msg=str(err))


if __name__ == "__main__":
    main()
