"""Host-side code of gptoss-host, by runtime (see docs/design.md, "Layout by runtime"):
service/host/ runs on the host's system python3 (stdlib only), service/venv/ with a product venv's
python (vLLM's or the router's). Controller-only code lives in controller/, never here.

The version-chain rules (vLLM -> torch -> CUDA -> driver) live in the Ansible collection's
module_utils, their one home, which the roles' modules import too. On a host, gptoss_base ships that
package next to service/ (/opt/gptoss/lib/ansible_collections/...), and verify.yml next to its copy;
in a checkout it is under collections/, which is put on sys.path here so `python3 -m service.host.X`
works from the repository root as well.
"""

import sys
from pathlib import Path

_CHECKOUT_COLLECTIONS = Path(__file__).resolve().parent.parent / "collections"
if (_CHECKOUT_COLLECTIONS / "ansible_collections").is_dir() and str(_CHECKOUT_COLLECTIONS) not in sys.path:
    sys.path.append(str(_CHECKOUT_COLLECTIONS))
