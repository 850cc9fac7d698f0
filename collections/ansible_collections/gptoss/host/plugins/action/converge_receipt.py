"""Action plugin for gptoss.host.converge_receipt: the inputs digest is computed here, on the controller.

The inputs of a converge are on the controller: the project's files, the variables of every
inventory host (the router lists other hosts' servers), the facts the roles read, and the
controller files the roles copy from (a model folder, a repository key). Their digest goes to the
module as `inputs`; the host never sees the values (an API key among the variables stays here).
"""

from __future__ import annotations

import os

from ansible.errors import AnsibleActionFail
from ansible.plugins.action import ActionBase
from ansible_collections.gptoss.host.plugins.module_utils import converge_receipt


class ActionModule(ActionBase):
    TRANSFERS_FILES = False

    def run(self, tmp=None, task_vars=None):
        result = super().run(tmp, task_vars)
        task_vars = task_vars or {}
        args = dict(self._task.args)
        sources = args.pop("sources", None) or []
        prefixes = list(args.pop("var_prefixes", None) or [])
        # Every role's variables are inputs: '<role>_' for each folder of a roles/ source, so a new
        # role is covered without editing a list.
        for source in sources:
            if os.path.basename(os.path.normpath(source)) == "roles" and os.path.isdir(source):
                prefixes += sorted(f"{name}_" for name in os.listdir(source)
                                   if os.path.isdir(os.path.join(source, name)))
        facts = args.pop("facts", None) or []
        controller_files = [path for path in args.pop("controller_files", None) or [] if path]
        # A write passes the digest its run's first check computed: the plays of one run see
        # different role defaults, so a digest made later in the run would never match.
        if args.get("state", "check") != "absent" and not args.get("inputs"):
            if not sources or not prefixes:
                raise AnsibleActionFail("converge_receipt: sources and var_prefixes are required to digest the inputs")
            args["inputs"] = self.inputs(task_vars, sources, prefixes, facts, controller_files)
        result.update(self._execute_module(module_name="gptoss.host.converge_receipt", module_args=args,
                                           task_vars=task_vars))
        result["inputs"] = args.get("inputs", "")
        return result

    @staticmethod
    def inputs(task_vars, sources, prefixes, facts, controller_files) -> str:
        hostvars = task_vars.get("hostvars")
        groups = task_vars.get("groups") or {}
        variables = {"groups": {name: sorted(hosts) for name, hosts in groups.items()},
                     "this host": converge_receipt.selected_vars(task_vars, prefixes, facts)}
        for host in sorted(groups.get("all", [])):
            raw = hostvars.raw_get(host) if hostvars is not None else {}
            variables[f"host {host}"] = converge_receipt.selected_vars(raw, prefixes, ())
        return converge_receipt.inputs_digest(converge_receipt.source_tree_digest(sources), variables,
                                              converge_receipt.controller_paths_digest(controller_files))
