"""Ansible's linear strategy over Mitogen: one Python per host for the whole play, not one per task.

With the stock transport every task pipes a fresh AnsiballZ payload into a new interpreter on the host,
which unzips and compiles ansible.module_utils again: about 0.19 s of the host's CPU per task on the lab
(docs/measurements.md, session 19). Mitogen keeps one interpreter per host (and per become user) for
the play and caches what it imported. Same task order and semantics as `linear`; ansible.cfg selects it
(`strategy = gptoss.host.mitogen_linear`), and ANSIBLE_STRATEGY=linear goes back to the stock one
(tests/test_converge_receipt_lab.py runs every role that way).
"""

from __future__ import annotations

DOCUMENTATION = r"""
name: mitogen_linear
short_description: Ansible's linear strategy, run over Mitogen's persistent connections
description:
  - The strategy plugin of the mitogen package (ansible_mitogen), exposed under this collection's name so
    that ansible.cfg needs no path into a virtualenv's site-packages.
requirements:
  - mitogen (a runtime dependency of gptoss-host, pinned in pyproject.toml)
"""

from ansible_mitogen.plugins.strategy.mitogen_linear import StrategyModule  # noqa: E402,F401 - DOCUMENTATION first, as every plugin
