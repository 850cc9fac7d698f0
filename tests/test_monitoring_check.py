"""monitoring_check's pure parts, against values the real services printed."""

from pathlib import Path

from service.host import monitoring_check

DATA = Path(__file__).parent / "data"


def test_alertmanager_config_hash_matches_what_alertmanager_exports():
    """Alertmanager 0.25 (Debian 12's prometheus-alertmanager, run by hand on this file) exported
    `alertmanager_config_hash 2.38955905961135e+14`: MON-003 compares it with the file's."""
    data = (DATA / "alertmanager-0.25-hash.yml").read_bytes()
    assert monitoring_check.alertmanager_config_hash(data) == 238955905961135.0
    assert monitoring_check.alertmanager_config_hash(data + b"\n") != 238955905961135.0
