"""Whether an address is a loopback address: the one rule, for every role, module and check.

'localhost', any IPv4 address in 127.0.0.0/8, ::1, an IPv4-mapped IPv6 form of those
(::ffff:127.0.0.1), written with or without IPv6 brackets or a zone (%lo). A host name other than
'localhost' is not loopback, even one that starts with "127.". Used by unit_inputs (an API key off
loopback), listening_sockets (verify NET-001), router_config (a remote server on loopback) and, through
the filter gptoss.host.is_loopback, by the roles' YAML (webui's listen address). Standard library only.
"""

from __future__ import annotations

import ipaddress


def is_loopback(address: object) -> bool:
    text = str(address or "").strip()
    if text.lower() == "localhost":
        return True
    text = text.removeprefix("[").removesuffix("]").split("%", 1)[0]
    try:
        ip = ipaddress.ip_address(text)
    except ValueError:
        return False
    if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped is not None:
        ip = ip.ipv4_mapped
    return ip.is_loopback
