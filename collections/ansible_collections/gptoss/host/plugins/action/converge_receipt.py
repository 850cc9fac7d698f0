"""Action plugin for gptoss.host.converge_receipt: the inputs digest is computed here, on the controller.

The inputs of a converge are on the controller: the project's files, the values of the variables the
roles read for every inventory host (templated as the roles will see them: plugin_utils/receipt_inputs.py
says why and how), the inventory and vault files, the extra vars, the facts the roles read, and the
controller files the roles copy from (a model folder, a repository key). Their digest goes to the
module as `inputs`; the host never sees a value (an API key stays here), and the receipt holds only
the digest.
"""

from __future__ import annotations

import hashlib
import os
import time

from ansible.errors import AnsibleActionFail
from ansible.plugins.action import ActionBase
from ansible.utils.vars import load_extra_vars
from ansible_collections.gptoss.host.plugins.module_utils import converge_receipt
from ansible_collections.gptoss.host.plugins.plugin_utils import receipt_inputs


class ActionModule(ActionBase):
    TRANSFERS_FILES = False

    def run(self, tmp=None, task_vars=None):
        result = super().run(tmp, task_vars)
        task_vars = task_vars or {}
        args = dict(self._task.args)
        sources = args.pop("sources", None) or []
        prefixes = list(args.pop("var_prefixes", None) or [])
        roles_dir = next((s for s in sources if os.path.basename(os.path.normpath(s)) == "roles"
                          and os.path.isdir(s)), "")
        # Every role's variables are inputs: '<role>_' for each folder of a roles/ source, so a new
        # role is covered without editing a list.
        roles = sorted(n for n in (os.listdir(roles_dir) if roles_dir else [])
                       if os.path.isdir(os.path.join(roles_dir, n)))
        prefixes += [f"{name}_" for name in roles]
        facts = args.pop("facts", None) or []
        controller_files = [path for path in args.pop("controller_files", None) or [] if path]
        # A write passes the digest its run's first check computed: the plays of one run see
        # different role defaults, so a digest made later in the run would never match.
        if args.get("state", "check") != "absent" and not args.get("inputs"):
            if not sources or not prefixes:
                raise AnsibleActionFail("converge_receipt: sources and var_prefixes are required to digest the inputs")
            args["inputs"], problems = self.inputs(task_vars, sources, roles_dir, roles, prefixes, facts,
                                                   controller_files)
            args["input_problems"] = problems
        result.update(self._execute_module(module_name="gptoss.host.converge_receipt", module_args=args,
                                           task_vars=task_vars))
        result["inputs"] = args.get("inputs", "")
        return result

    def role_defaults(self, roles_dir: str, roles: list[str]) -> dict:
        """Every role's defaults (raw): a variable of a role that is not in this play is still
        templated with the defaults it names, as that role's play will see them."""
        defaults: dict = {}
        for role in roles:
            path = os.path.join(roles_dir, role, "defaults", "main.yml")
            if os.path.isfile(path):
                defaults.update(self._loader.load_from_file(path) or {})
        return defaults

    def inputs(self, task_vars, sources, roles_dir, roles, prefixes, facts, controller_files) -> tuple[str, list[str]]:
        defaults = self.role_defaults(roles_dir, roles)
        hostvars = task_vars.get("hostvars")
        groups = task_vars.get("groups") or {}
        this_host = task_vars.get("inventory_hostname")
        # This host as the play sees it; every other host (the router lists their servers) from
        # the inventory, each over the role defaults.
        hosts = {this_host: {**defaults, **task_vars}}
        for host in sorted(groups.get("all", [])):
            if host != this_host and hostvars is not None:
                hosts[host] = {**defaults, **hostvars.raw_get(host), "hostvars": hostvars, "groups": groups}
        problems = [f"{where}: {problem}" for where, variables in hosts.items()
                    for problem in receipt_inputs.unsafe_lookups(variables)]
        variables: dict = {"groups": {name: sorted(members) for name, members in groups.items()}}
        if not problems:
            for host, host_vars in hosts.items():
                values, host_problems = receipt_inputs.template_selection(
                    self.templater(host_vars, roles_dir), host_vars,
                    receipt_inputs.selected_names(host_vars, prefixes), defaults, roles)
                variables[f"host {host}"] = values
                problems += [f"{host}: {problem}" for problem in host_problems]
        ansible_facts = task_vars.get("ansible_facts") or {}
        variables["facts"] = {name: ansible_facts.get(name) for name in facts}
        variables["extra vars"] = load_extra_vars(self._loader)
        inventory = receipt_inputs.files_digest(receipt_inputs.inventory_paths(
            task_vars.get("ansible_inventory_sources") or [], task_vars.get("playbook_dir") or ""))
        digest = converge_receipt.inputs_digest(converge_receipt.source_tree_digest(sources),
                                                {**variables, "inventory files": inventory},
                                                converge_receipt.controller_paths_digest(controller_files))
        if problems:
            # Never equal to any receipt's: the run is a full converge, and says why.
            digest = "unverifiable:" + hashlib.sha256(f"{digest} {time.time_ns()}".encode()).hexdigest()
        return digest, problems

    def templater(self, host_vars: dict, roles_dir: str):
        """template(raw, role): the value as the roles will see it, with that role's role_path."""
        templars: dict = {}

        def template(raw, role: str):
            if role not in templars:
                env = {**host_vars, "role_path": os.path.join(roles_dir, role)} if role else host_vars
                templars[role] = self._templar.copy_with_new_env(available_variables=env)
            return templars[role].template(raw)

        return template
