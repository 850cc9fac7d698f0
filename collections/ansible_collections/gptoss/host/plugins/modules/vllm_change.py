#!/usr/bin/python
"""Ansible module: change what the vLLM unit reads as one transaction behind the health gate."""

from __future__ import annotations

DOCUMENTATION = r"""
---
module: vllm_change
short_description: Change the vLLM unit's inputs as one transaction, restart behind the health gate, undo all on failure
description:
  - The inputs are the unit file, the files it reads (arguments, env files, the secrets file) and the
    verify record. They are checked first, then written together, then the server is restarted and
    must pass the health gate (/health and one real completion).
  - Refused before anything changes, with the reason - an API key that systemd cannot pass unchanged
    (the rule is in the message), a port held by a process outside the unit, too little free space.
  - On any failure after the first write, every input goes back to its previous bytes (or away when
    it did not exist), the previous configuration is restarted, and the gate waits on the previous
    configuration's address and key. The message says what happened and whether it serves again.
  - The server restarts whenever the content of anything it reads differs from what the running
    process started with, whichever task or person changed it (see I(watch)).
  - A unit that systemd gave up on (start limit, failed state) is reset with C(systemctl reset-failed)
    first, and the result says so.
  - The secrets file never gets a backup and old backups of it are removed; other files keep the
    last I(keep_backups) backups.
  - One change at a time per host - a kernel lock (flock on I(lock_file)) is held for the whole
    transaction; a second run waits up to I(lock_wait_s), then fails naming the holder and since when.
options:
  unit: {description: The systemd unit., type: str, required: true}
  files:
    description: Files the unit reads (and the verify record is separate). Each is path, content, mode.
    type: list
    elements: dict
    required: true
  api_key: {description: The API key ('' = none)., type: str, default: '', no_log: true}
  secrets_file: {description: "Where the key goes, as VLLM_API_KEY='<key>' (0600, root).", type: path, required: true}
  watch:
    description: Files the unit reads that other roles manage (a change restarts the server).
    type: list
    elements: path
    default: []
  record_path: {description: The verify record (JSON)., type: path, required: true}
  record: {description: "What verify must find: base_url, served_model_name, ...", type: dict, required: true}
  gate_python: {description: Python that runs service.rollout on the host., type: path, default: /usr/bin/python3}
  gate_lib_dir: {description: PYTHONPATH for service.rollout., type: path, default: /opt/gptoss/lib}
  gate_timeout_s: {description: Seconds the gate waits for /health and a completion., type: int, default: 900}
  stamp_file:
    description: What the running process started with (written after each gated start).
    type: path
    default: /var/lib/gptoss/vllm-started.json
  keep_backups: {description: Backups kept per non-secret file., type: int, default: 3}
  min_free_mb: {description: Free space needed where the files go., type: int, default: 16}
  lock_file: {description: The per-host change lock., type: path, default: /run/gptoss/change.lock}
  lock_wait_s: {description: Seconds to wait for the lock (0 = fail at once)., type: int, default: 1200}
  holder: {description: Who takes the lock (shown to a second run)., type: str, default: converge}
  drain:
    description:
      - Drain through vllm-router when this change restarts the unit - {router_url, worker_url, timeout_s}.
      - Before anything is written the unit is removed from the router and its in-flight requests are
        awaited (at most timeout_s); after the gate passes it is added back. A failed gate leaves it out
        of the router (the rest keep serving) and says so. Empty - no router.
    type: dict
    default: {}
author: gptoss-host
"""

EXAMPLES = r"""
- name: Roll out the unit
  gptoss.host.vllm_change:
    unit: gptoss-vllm.service
    files:
      - {path: /etc/systemd/system/gptoss-vllm.service, content: "{{ lookup('template', 'unit.j2') }}"}
    secrets_file: /etc/gptoss/vllm-secrets.env
    record_path: /etc/gptoss/verify.d/vllm_service.json
    record: {base_url: "http://127.0.0.1:8000", served_model_name: tiny}
"""

RETURN = r"""
changed_files: {description: Inputs whose content changed, type: list, returned: always}
restarted: {description: Whether the server was (re)started, type: bool, returned: always}
restart_reasons: {description: Why it was restarted (or would be in check mode), type: list, returned: always}
reset_failed: {description: What systemd's failed state was before reset-failed, or empty, type: str, returned: always}
rollout: {description: The health gate's JSON result, type: dict, returned: when the gate ran}
lock_waited_s: {description: Seconds this run waited for the change lock, type: float, returned: not check mode}
lock_waited_for: {description: Who held the lock while this run waited, or empty, type: str, returned: not check mode}
"""

import contextlib
import fcntl
import glob
import json
import os
import shutil
import tempfile
import time
from urllib.parse import urlparse

from ansible.module_utils.basic import AnsibleModule
from ansible_collections.gptoss.host.plugins.module_utils import router_drain, unit_inputs, verify_contract

UNIT_DIR = "/etc/systemd/system"


class ChangeFailed(Exception):
    """A step after the first write failed; the transaction is undone."""


class Transaction:
    def __init__(self, module: AnsibleModule):
        self.module = module
        self.params = module.params
        self.unit = module.params["unit"]
        self.files = self._desired_files()
        self.before = {path: self._read(path) for path in self.files}
        self.written: list[str] = []
        self.backups: list[str] = []  # made by this run; an undo removes them again
        self.unit_path = os.path.join(UNIT_DIR, self.unit)

    # ---------------------------------------------------------------- inputs
    def _desired_files(self) -> dict[str, dict]:
        params = self.params
        try:
            secrets = unit_inputs.secrets_file_text(params["api_key"])
        except ValueError as exc:
            self.module.fail_json(msg=f"{exc}; nothing was changed")
        files: dict[str, dict] = {}
        for entry in params["files"]:
            files[entry["path"]] = {"content": entry["content"].encode(), "secret": False, "read_by_unit": True,
                                    "mode": int(str(entry.get("mode", "0644")), 8)}
        files[params["secrets_file"]] = {"content": secrets.encode(), "mode": 0o600, "secret": True,
                                         "read_by_unit": True}
        record = dict(params["record"], inputs=self.watched_paths(files), stamp_file=params["stamp_file"])
        try:  # the verify contract's one check, as for every other role's record
            record = verify_contract.check_record("vllm_service", record)
        except verify_contract.ContractError as exc:
            self.module.fail_json(msg=f"{exc}; nothing was changed")
        files[params["record_path"]] = {"content": verify_contract.render(record).encode(),
                                        "mode": 0o644, "secret": False, "read_by_unit": False}
        return files

    def watched_paths(self, files: dict[str, dict] | None = None) -> list[str]:
        files = self.files if files is None else files
        return sorted({p for p, f in files.items() if f["read_by_unit"]} | set(self.params["watch"]))

    @staticmethod
    def _read(path: str) -> bytes | None:
        try:
            with open(path, "rb") as handle:
                return handle.read()
        except FileNotFoundError:
            return None

    def changed_paths(self) -> list[str]:
        return [p for p, f in self.files.items() if self.before[p] != f["content"]]

    @staticmethod
    def record_of(content: bytes | None) -> dict:
        try:
            return json.loads(content or b"{}")
        except ValueError:
            return {}

    # ---------------------------------------------------------------- preflight
    def preflight(self, state: dict[str, str]) -> None:
        """Everything that can be known before the live server is touched."""
        new_url = urlparse(str(self.params["record"].get("base_url", "")))
        if new_url.port:
            host = new_url.hostname or "0.0.0.0"
            holder = unit_inputs.port_conflict(new_url.port, self.unit, host)
            if holder:
                self.module.fail_json(msg=(
                    f"{new_url.hostname}:{new_url.port} is held by {holder}, not by {self.unit}; "
                    f"refused before anything changed (the running server, PID {state.get('MainPID', '0')}, "
                    "was not touched). Free the port or choose another vllm_service_port."))
        for directory in sorted({os.path.dirname(p) or "/" for p in self.files}):
            probe = directory
            while not os.path.exists(probe):
                probe = os.path.dirname(probe)
            free_mb = shutil.disk_usage(probe).free // (1 << 20)
            if free_mb < self.params["min_free_mb"]:
                self.module.fail_json(msg=f"{probe} has {free_mb} MiB free, need {self.params['min_free_mb']} MiB; "
                                          "nothing was changed")

    # ---------------------------------------------------------------- files
    def write(self, path: str, content: bytes | None, mode: int) -> None:
        if content is None:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(path)
            return
        directory = os.path.dirname(path)
        os.makedirs(directory, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=f".{os.path.basename(path)}.", dir=directory)
        try:
            os.fchmod(fd, mode)
            os.fchown(fd, 0, 0)
            with os.fdopen(fd, "wb") as handle:
                handle.write(content)
                handle.flush()
                os.fsync(handle.fileno())
            os.replace(tmp, path)
        finally:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(tmp)

    def prune_backups(self, path: str, secret: bool) -> list[str]:
        """Remove every backup of a secret file; keep the newest keep_backups of the others."""
        backups = sorted(glob.glob(glob.escape(path) + ".*~"), key=os.path.getmtime, reverse=True)
        doomed = backups if secret else backups[self.params["keep_backups"]:]
        for old in doomed:
            os.unlink(old)
        return doomed

    def backup(self, path: str) -> None:
        previous = self.before[path]
        if previous is None or self.files[path]["secret"] or self.params["keep_backups"] <= 0:
            return
        backup = f"{path}.{time.strftime('%Y%m%dT%H%M%S')}.gptoss~"
        self.write(backup, previous, os.stat(path).st_mode & 0o777)
        self.backups.append(backup)

    # ---------------------------------------------------------------- systemd
    def systemctl(self, *args: str, check: bool = True) -> tuple[int, str]:
        code, out, err = self.module.run_command(["systemctl", *args])
        if check and code != 0:
            raise ChangeFailed(f"systemctl {' '.join(args)} failed (exit {code}): {err.strip() or out.strip()}")
        return code, (out + err).strip()

    def state(self) -> dict[str, str]:
        props = ("MainPID", "ActiveState", "SubState", "Result", "NRestarts", "UnitFileState", "LoadState")
        return unit_inputs.unit_show(self.unit, props)

    def reset_if_failed(self) -> str:
        """reset-failed a unit in the failed state; say why it was there.

        systemd 252 keeps the last Result (e.g. 'signal') when it gives up at the start limit, so the
        start limit is recognised by its journal line, not by Result=start-limit-hit alone.
        """
        state = unit_inputs.unit_show(self.unit, ("ActiveState", "Result", "NRestarts", "StartLimitBurst",
                                                  "StartLimitIntervalUSec"))
        if state.get("ActiveState") != "failed":
            return ""
        _, journal, _ = self.module.run_command(["journalctl", "-u", self.unit, "-n", "5", "--no-pager", "-o", "cat"])
        if state.get("Result") == "start-limit-hit" or "Start request repeated too quickly" in journal:
            why = (f"systemd had given up on it after repeated crashes (start limit hit: {state.get('StartLimitBurst')}"
                   f" starts in {state.get('StartLimitIntervalUSec')}; last result {state.get('Result')})")
        else:
            why = f"it had failed (Result={state.get('Result')})"
        self.systemctl("reset-failed", self.unit)
        return f"{self.unit}: {why}, NRestarts={state.get('NRestarts')}; ran systemctl reset-failed"

    def gate(self, record: dict, since: float | None) -> dict:
        """Wait for /health and one completion on the address, model and key of `record`."""
        argv = [self.params["gate_python"], "-m", "service.rollout", "wait",
                "--base-url", str(record.get("base_url", "")), "--model", str(record.get("served_model_name", "")),
                "--timeout", str(self.params["gate_timeout_s"]), "--unit", self.unit]
        if record.get("api_key_file"):
            argv += ["--api-key-file", str(record["api_key_file"])]
        if since:
            argv += ["--since-epoch", f"{since:.3f}"]
        code, out, err = self.module.run_command(argv, environ_update={"PYTHONPATH": self.params["gate_lib_dir"]})
        try:
            result = json.loads(out.strip().splitlines()[-1])
        except (ValueError, IndexError):
            result = {"ok": False, "reason": f"gate exit {code}: {(err or out).strip()[-500:]}"}
        if code != 0 and result.get("ok"):
            result = {"ok": False, "reason": f"gate exit {code}"}
        return result

    def journal_tail(self) -> list[str]:
        _, out, _ = self.module.run_command(["journalctl", "-u", self.unit, "-n", "40", "--no-pager", "-o", "cat"])
        return out.splitlines()

    def write_stamp(self) -> None:
        pid = int(self.state().get("MainPID", "0") or 0)
        if pid > 0:
            text = unit_inputs.stamp_text(self.watched_paths(), pid).encode()
            if self._read(self.params["stamp_file"]) != text:
                self.write(self.params["stamp_file"], text, 0o644)

    # ---------------------------------------------------------------- the transaction
    def restart_reasons(self, state: dict[str, str], changed: list[str]) -> list[str]:
        reasons = [f"{p} changed" for p in changed if self.files[p]["read_by_unit"]]
        pid = int(state.get("MainPID", "0") or 0)
        if pid > 0:
            pending = unit_inputs.pending_changes(self.watched_paths(), pid, self.params["stamp_file"])
            reasons += [f"{p} differs from what PID {pid} started with" for p in pending if p not in changed]
        if state.get("ActiveState") != "active":
            reasons.append(f"{self.unit} is {state.get('ActiveState')} ({state.get('Result')})")
        return reasons

    def diff(self, changed: list[str]) -> list[dict]:
        out = []
        for path in changed:
            if self.files[path]["secret"]:
                out.append({"before_header": path, "after_header": path,
                            "before": "(secret, not shown)\n", "after": "(secret changed, not shown)\n"})
            else:
                out.append({"before_header": path, "after_header": path,
                            "before": (self.before[path] or b"").decode(errors="replace"),
                            "after": self.files[path]["content"].decode(errors="replace")})
        return out

    def apply(self) -> dict:
        state = self.state()
        changed = self.changed_paths()
        reasons = self.restart_reasons(state, changed)
        result = {"changed_files": changed, "restart_reasons": reasons, "restarted": False, "reset_failed": "",
                  "diff": self.diff(changed)}
        self.preflight(state)  # in check mode too: it tells what a real run would refuse
        if self.module.check_mode:
            return dict(result, changed=bool(changed or reasons))
        enable = state.get("UnitFileState") != "enabled"
        drain = self.params["drain"] or {}
        if reasons and drain:
            try:  # before anything is written: a router that does not answer changes nothing
                result["drain"] = router_drain.take_out(drain["router_url"], drain["worker_url"],
                                                        float(drain.get("timeout_s", 60)))
            except router_drain.DrainError as exc:
                self.module.fail_json(msg=f"vllm_change: could not take {drain['worker_url']} out of the router "
                                          f"({exc}); nothing was changed", **result)
        try:
            for path in changed:
                self.backup(path)
                self.written.append(path)
                self.write(path, self.files[path]["content"], self.files[path]["mode"])
            if self.unit_path in changed or state.get("LoadState") == "not-found":
                self.systemctl("daemon-reload")
            if enable:
                self.systemctl("enable", self.unit)
            rollout = None
            if reasons:
                result["reset_failed"] = self.reset_if_failed()
                since = time.time()
                self.systemctl("restart", self.unit)
                result["restarted"] = True
                rollout = self.gate(self.params["record"], since)
            else:
                rollout = self.gate(self.params["record"], None)  # every run proves the server serves
            result["rollout"] = rollout
            if not rollout.get("ok"):
                raise ChangeFailed(str(rollout.get("reason")))
        except (ChangeFailed, OSError, RuntimeError) as exc:
            if result.get("drain", {}).get("was_listed"):
                exc = ChangeFailed(f"{exc} ({drain['worker_url']} is left out of the router {drain['router_url']})")
            self.undo(str(exc), state, result)
        if result.get("drain", {}).get("was_listed"):
            try:
                result["drain"].update(router_drain.put_back(drain["router_url"], drain["worker_url"]))
            except router_drain.DrainError as exc:
                self.module.fail_json(msg=f"vllm_change: serving with the new configuration, but not back in "
                                          f"the router: {exc}", **{k: v for k, v in result.items() if k != "diff"})
        self.write_stamp()
        for path, spec in self.files.items():
            self.prune_backups(path, spec["secret"])
        for path in self.params["watch"]:  # other roles' files the unit reads: bounded too
            self.prune_backups(path, secret=False)
        return dict(result, changed=bool(changed or result["restarted"] or enable))

    def undo(self, reason: str, state_before: dict[str, str], result: dict) -> None:
        journal = self.journal_tail()
        restored = []
        for path in self.written:
            self.write(path, self.before[path], self.files[path]["mode"])
            restored.append(path if self.before[path] is not None else f"{path} (removed: it did not exist)")
        for backup in self.backups:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(backup)
        for path, spec in self.files.items():
            self.prune_backups(path, spec["secret"])
        notes = []
        try:
            self.systemctl("daemon-reload")
            self.systemctl("reset-failed", self.unit, check=False)
            was_serving = state_before.get("ActiveState") == "active" and self.before[self.unit_path] is not None
            if was_serving and self.written:
                since = time.time()
                self.systemctl("restart", self.unit)
                previous = self.record_of(self.before[self.params["record_path"]])
                back = self.gate(previous, since)
                notes.append(f"previous configuration restarted; serving again on {previous.get('base_url')}: "
                             + ("yes" if back.get("ok") else f"NO ({back.get('reason')})"))
            elif was_serving:
                notes.append("nothing had been written, so the running server was left as it was")
            else:
                self.systemctl("stop", self.unit, check=False)
                notes.append(f"{self.unit} was not serving before this change; it is stopped")
        except (ChangeFailed, OSError, RuntimeError) as exc:
            notes.append(f"the undo itself failed: {exc}")
        what = (f"the new configuration did not serve: {reason}. Restored {len(restored)} input(s) to their "
                f"previous content: {', '.join(restored)}." if self.written
                else f"the server does not serve, and this run changed nothing: {reason}.")
        self.module.fail_json(
            msg=(f"vllm_change: {what} " + " ".join(notes)
                 + (f" {result['reset_failed']}." if result["reset_failed"] else "")
                 + "\nJournal tail:\n" + "\n".join(journal[-15:])),
            restored=restored, journal=journal[-40:], **{k: v for k, v in result.items() if k != "diff"})


@contextlib.contextmanager
def change_lock(module: AnsibleModule):
    """Hold the host's change lock (flock: the kernel drops it when this process dies)."""
    path = module.params["lock_file"]
    os.makedirs(os.path.dirname(path), exist_ok=True)
    handle = open(path, "a+")  # noqa: SIM115 - held for the whole transaction
    started = time.time()
    deadline = started + module.params["lock_wait_s"]
    waited_for = ""
    while True:
        try:
            fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
            break
        except BlockingIOError:
            handle.seek(0)
            holder = handle.read().strip() or "unknown"
            waited_for = waited_for or holder
            if time.time() >= deadline:
                module.fail_json(msg=f"another change holds {path}: {holder}; waited "
                                     f"{module.params['lock_wait_s']} s; nothing was changed")
            time.sleep(2)
    handle.seek(0)
    handle.truncate()
    handle.write(f"{module.params['holder']} (PID {os.getpid()}) since "
                 f"{time.strftime('%Y-%m-%d %H:%M:%S %Z')}\n")
    handle.flush()
    try:
        yield {"lock_waited_s": round(time.time() - started, 1), "lock_waited_for": waited_for}
    finally:
        handle.seek(0)
        handle.truncate()
        handle.close()


def main() -> None:
    module = AnsibleModule(
        argument_spec={
            "unit": {"type": "str", "required": True},
            "files": {"type": "list", "elements": "dict", "required": True},
            "api_key": {"type": "str", "default": "", "no_log": True},
            "secrets_file": {"type": "path", "required": True},
            "watch": {"type": "list", "elements": "path", "default": []},
            "record_path": {"type": "path", "required": True},
            "record": {"type": "dict", "required": True},
            "gate_python": {"type": "path", "default": "/usr/bin/python3"},
            "gate_lib_dir": {"type": "path", "default": "/opt/gptoss/lib"},
            "gate_timeout_s": {"type": "int", "default": 900},
            "stamp_file": {"type": "path", "default": "/var/lib/gptoss/vllm-started.json"},
            "keep_backups": {"type": "int", "default": 3},
            "min_free_mb": {"type": "int", "default": 16},
            "lock_file": {"type": "path", "default": "/run/gptoss/change.lock"},
            "lock_wait_s": {"type": "int", "default": 1200},
            "holder": {"type": "str", "default": "converge"},
            "drain": {"type": "dict", "default": {}},
        },
        supports_check_mode=True,
    )
    try:
        unit_inputs.secrets_file_text(module.params["api_key"])
    except ValueError as exc:  # refused before the lock and before anything is read or written
        module.fail_json(msg=f"{exc}; nothing was changed")
    if module.check_mode:
        result = Transaction(module).apply()
    else:
        with change_lock(module) as lock:
            result = dict(Transaction(module).apply(), **lock)
    diff = result.pop("diff")
    module.exit_json(diff=diff if module._diff else None, **result)


if __name__ == "__main__":
    main()
