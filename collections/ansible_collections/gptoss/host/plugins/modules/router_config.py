#!/usr/bin/python
"""Ansible module: the router's worker list and arguments from the inventory (read-only)."""

from __future__ import annotations

DOCUMENTATION = r"""
---
module: router_config
short_description: Compute vllm-router's workers and command line from the inventory
description:
  - Applies the project's router rules (module_utils/router_config.py) and returns the worker URLs
    and the body of /etc/gptoss/router.json that the launcher reads. It changes nothing; the role
    writes the file (so check mode and diff come from the file module).
  - Every serving unit of every host is a worker; a host with instances contributes one worker per
    instance. Two units on one address and port, or no worker, is refused.
  - The API key is not an input: it never enters the config or the command line.
options:
  hosts:
    description: One entry per host, {name, address, port, instances}; instances is a list of {name, port}.
    type: list
    elements: dict
    required: true
  settings:
    description: host, port, policy, prometheus_host/port and the health/retry/circuit-breaker numbers.
    type: dict
    default: {}
author: gptoss-host
"""

EXAMPLES = r"""
- name: Compute the router config
  gptoss.host.router_config:
    hosts: [{name: box1, address: 10.0.0.5, port: 8000, instances: []}]
    settings: {host: 127.0.0.1, port: 8100, policy: cache_aware}
  register: router
"""

RETURN = r"""
workers: {description: The worker URLs, type: list, returned: always}
argv: {description: The vllm-router arguments (no key), type: list, returned: always}
content: {description: The router.json body, type: str, returned: always}
"""

import json

from ansible.module_utils.basic import AnsibleModule
from ansible_collections.gptoss.host.plugins.module_utils.router_config import RouterConfigError, render_config


def main() -> None:
    module = AnsibleModule(
        argument_spec=dict(
            hosts=dict(type="list", elements="dict", required=True),
            settings=dict(type="dict", default={}),
        ),
        supports_check_mode=True,
    )
    try:
        content = render_config(module.params["settings"], module.params["hosts"])
    except RouterConfigError as exc:
        module.fail_json(msg=f"router_config: {exc}")
    data = json.loads(content)
    module.exit_json(changed=False, workers=data["workers"], argv=data["argv"], content=content)


if __name__ == "__main__":
    main()
