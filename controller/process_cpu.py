"""CPU seconds of the programs this process ran: what a play costs on the controller.

The one home of that reading for the test suite's record (tests/run_times.py) and the converge bench
(bench/bench_converge.py): both run ansible-playbook as a child and wait for it, so its CPU (and that of
the workers it forked and reaped) is in this process's RUSAGE_CHILDREN once it has ended.
"""

from __future__ import annotations

import resource


def children_cpu_s() -> float:
    """CPU seconds (user + system) of the children this process has waited for."""
    children = resource.getrusage(resource.RUSAGE_CHILDREN)
    return children.ru_utime + children.ru_stime
