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
  - The venv pointer (I(pointer), a symlink the unit runs through) is one more input - switched
    atomically to I(pointer_target) between the stop and the start of the server, so the old process
    never reads the new venv, and switched back with the files on failure.
  - Every configuration that passed the gate is kept in I(history_file) (files except the secret,
    record, pointer target). I(mode=rollback) takes the newest one that differs from what is on disk
    now as the wanted inputs and runs the same transaction, behind the same gate.
  - After a successful run, complete venvs under I(venvs_dir) beyond the I(keep_venvs) most recently
    used are removed - never the pointer's target, never the venv the running server loaded.
  - One change at a time per host - a kernel lock (flock on I(lock_file)) is held for the whole
    transaction; a second run waits up to I(lock_wait_s), then fails naming the holder and since when.
options:
  unit: {description: The systemd unit., type: str, required: true}
  files:
    description: Files the unit reads (and the verify record is separate). Each is path, content, mode.
    type: list
    elements: dict
    default: []
  mode: {description: "converge: the inputs given; rollback: the previous configuration from history_file.",
         type: str, choices: [converge, rollback], default: converge}
  pointer: {description: The venv pointer symlink the unit runs through ('' = none)., type: path, default: ''}
  pointer_target: {description: The versioned venv the pointer should point at., type: path, default: ''}
  venvs_dir: {description: Where the versioned venvs live (retention)., type: path, default: ''}
  keep_venvs: {description: Complete venvs kept after a successful switch., type: int, default: 2}
  history_file: {description: Configurations that passed the gate (for rollback)., type: path,
                 default: /var/lib/gptoss/vllm-history.json}
  api_key: {description: The API key ('' = none)., type: str, default: '', no_log: true}
  secrets_file: {description: "Where the key goes, as VLLM_API_KEY='<key>' (0600, root).", type: path, required: true}
  watch:
    description: Files the unit reads that other roles manage (a change restarts the server).
    type: list
    elements: path
    default: []
  record_path: {description: The verify record (JSON)., type: path, required: true}
  record: {description: "What verify must find: base_url, served_model_name, ...", type: dict, default: {}}
  gate_python: {description: Python that runs service.host.rollout on the host., type: path, default: /usr/bin/python3}
  gate_lib_dir: {description: PYTHONPATH for service.host.rollout., type: path, default: /opt/gptoss/lib}
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
      - Drain through vllm-router when this change restarts the unit - {router_url, worker_url, timeout_s,
        on_timeout}.
      - Before anything is written the unit is removed from the router and its in-flight requests are
        awaited (at most timeout_s). If requests are still running then, on_timeout decides - C(abort)
        (the default) puts the unit back into the router and fails, nothing changed; C(proceed) restarts
        anyway and reports the requests it cut (drain.cut). Either way the result says how many were in
        flight when it moved on (drain.in_flight, drain.summary).
      - After the gate passes the unit is in the router (added when missing, also when an earlier failure
        had left it out). On any failure after the drain, the unit goes back into the router when the undo
        has it serving again (the previous configuration passed the gate, or the server was never
        restarted); a unit that does not serve stays out of the router (the rest keep serving, verify
        RTR-001 fails) and the message says which. A router that is not running yet is left alone.
        Empty - no router.
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
pointer: {description: "The pointer's target before and after: {before, after}", type: dict, returned: always}
removed_venvs: {description: Venvs removed by retention (or that would be in check mode), type: list, returned: always}
rolled_back_to: {description: The history entry a rollback restored, type: dict, returned: rollback}
drain: {description: "The drain - was_listed, drained, waited_s, in_flight, on_timeout, cut, summary", type: dict,
        returned: when a drain ran}
"""

import contextlib
import fcntl
import glob
import json
import os
import shutil
import time
from urllib.parse import urlparse

from ansible.module_utils.basic import AnsibleModule
from ansible_collections.gptoss.host.plugins.module_utils import (
    atomic_file,
    router_drain,
    unit_inputs,
    venv_store,
    verify_contract,
)

UNIT_DIR = "/etc/systemd/system"


class ChangeFailed(Exception):
    """A step after the first write failed; the transaction is undone."""


class Transaction:
    def __init__(self, module: AnsibleModule):
        self.module = module
        self.params = module.params
        self.unit = module.params["unit"]
        self.rolled_back_to: dict = {}
        if self.params["mode"] == "rollback":
            self._take_previous_from_history()
        self.pointer = self.params["pointer"]
        if self.pointer and venv_store.is_legacy_dir(self.pointer):
            module.fail_json(msg=f"{self.pointer} is a real directory, not the venv pointer; gptoss.host.vllm_venv "
                                 "adopts it (the role runs it first); nothing was changed")
        self.pointer_before = venv_store.pointer_target(self.pointer) if self.pointer else None
        self.pointer_after = self.params["pointer_target"] or self.pointer_before
        self.pointer_switched = False
        self.files = self._desired_files()
        self.before = {path: self._read(path) for path in self.files}
        self.written: list[str] = []
        self.backups: list[str] = []  # made by this run; an undo removes them again
        self.unit_path = os.path.join(UNIT_DIR, self.unit)

    # ---------------------------------------------------------------- inputs
    def _take_previous_from_history(self) -> None:
        """Rollback: the newest configuration that passed the gate and differs from the one on disk."""
        history = load_history(self.params["history_file"])
        pointer = self.params["pointer"]
        now_target = venv_store.pointer_target(pointer) if pointer else None
        for entry in reversed(history):
            on_disk = all(self._read(f["path"]) == f["content"].encode() for f in entry["files"])
            if on_disk and entry.get("pointer_target") == now_target:
                continue
            target = entry.get("pointer_target")
            if target and venv_store.read_manifest(target) is None:
                self.module.fail_json(msg=f"rollback: the previous venv {target} is gone or incomplete "
                                          "(retention or a manual removal); nothing was changed")
            self.params.update(files=entry["files"], record=entry["record"], pointer_target=target or "")
            self.rolled_back_to = {"saved": entry.get("saved", ""), "pointer_target": target}
            return
        self.module.fail_json(msg=f"rollback: {self.params['history_file']} holds no configuration other than "
                                  f"the one running now ({len(history)} entr{'y' if len(history) == 1 else 'ies'}); "
                                  "nothing was changed")

    def _desired_files(self) -> dict[str, dict]:
        params = self.params
        if params["mode"] == "rollback":  # the key stays what it is; the history never holds it
            current = self._read(params["secrets_file"])
            secrets = current.decode() if current is not None else unit_inputs.NO_KEY_TEXT
        else:
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
        if self.pointer:  # verify (SVC-005) checks the running process against the pointer's target
            record.update(venv_pointer=self.pointer, venvs_dir=params["venvs_dir"])
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
        atomic_file.write_atomically(path, content, mode, owner_root=True, make_dirs=True)

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
        journal = unit_inputs.journal_tail(self.unit, 5)
        if state.get("Result") == "start-limit-hit" or any("Start request repeated too quickly" in line
                                                           for line in journal):
            why = (f"systemd had given up on it after repeated crashes (start limit hit: {state.get('StartLimitBurst')}"
                   f" starts in {state.get('StartLimitIntervalUSec')}; last result {state.get('Result')})")
        else:
            why = f"it had failed (Result={state.get('Result')})"
        self.systemctl("reset-failed", self.unit)
        return f"{self.unit}: {why}, NRestarts={state.get('NRestarts')}; ran systemctl reset-failed"

    def gate(self, record: dict, since: float | None) -> dict:
        """Wait for /health and one completion on the address, model and key of `record`."""
        argv = [self.params["gate_python"], "-m", "service.host.rollout", "wait",
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
        result.pop("journal", None)  # undo() shows the tail once, read with the same reader after the failure
        return result

    def write_stamp(self) -> None:
        pid = int(self.state().get("MainPID", "0") or 0)
        if pid > 0:
            text = unit_inputs.stamp_text(self.watched_paths(), pid).encode()
            if self._read(self.params["stamp_file"]) != text:
                self.write(self.params["stamp_file"], text, 0o644)

    # ---------------------------------------------------------------- the transaction
    def restart_reasons(self, state: dict[str, str], changed: list[str]) -> list[str]:
        reasons = [f"{p} changed" for p in changed if self.files[p]["read_by_unit"]]
        if self.pointer_changed():
            reasons.append(f"{self.pointer} -> {self.pointer_after} (was {self.pointer_before or 'absent'})")
        pid = int(state.get("MainPID", "0") or 0)
        if pid > 0:
            pending = unit_inputs.pending_changes(self.watched_paths(), pid, self.params["stamp_file"])
            reasons += [f"{p} differs from what PID {pid} started with" for p in pending if p not in changed]
            reasons += self.stale_venv_reasons(pid)
        if state.get("ActiveState") != "active":
            reasons.append(f"{self.unit} is {state.get('ActiveState')} ({state.get('Result')})")
        return reasons

    def stale_venv_reasons(self, pid: int) -> list[str]:
        """A server still running from another venv than the pointer names: the pointer was switched
        by another unit's change (replica instances share it) or by hand. SVC-005's rule, here."""
        venvs_dir, target = self.params["venvs_dir"], self.pointer_after
        if self.pointer_changed() or not (self.pointer and venvs_dir and target):
            return []
        try:
            loaded = venv_store.venv_of_process(pid, venvs_dir)
        except OSError:
            return []
        if loaded and os.path.normpath(loaded) != os.path.normpath(target):
            return [f"PID {pid} runs from {loaded}, {self.pointer} names {target}"]
        return []

    def pointer_changed(self) -> bool:
        return bool(self.pointer) and self.pointer_after != self.pointer_before

    def switch_pointer(self, target: str | None) -> None:
        venv_store.switch_pointer(self.pointer, target)

    def diff(self, changed: list[str]) -> list[dict]:
        out = []
        if self.pointer_changed():
            out.append({"before_header": self.pointer, "after_header": self.pointer,
                        "before": f"-> {self.pointer_before or '(absent)'}\n", "after": f"-> {self.pointer_after}\n"})
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
                  "diff": self.diff(changed), "pointer": {"before": self.pointer_before, "after": self.pointer_after},
                  "removed_venvs": []}
        if self.rolled_back_to:
            result["rolled_back_to"] = self.rolled_back_to
        self.preflight(state)  # in check mode too: it tells what a real run would refuse
        incomplete = self.pointer_changed() and venv_store.read_manifest(self.pointer_after or "") is None
        if incomplete and not self.module.check_mode:
            self.module.fail_json(msg=f"{self.pointer_after} is not a complete venv (no {venv_store.MANIFEST}); "
                                      "refused before anything changed",
                                  **{k: v for k, v in result.items() if k != "diff"})
        if self.module.check_mode:
            result["removed_venvs"] = self.retention(state, dry_run=True)
            return dict(result, changed=bool(changed or reasons or result["removed_venvs"]))
        enable = state.get("UnitFileState") != "enabled"
        drain = self.params["drain"] or {}
        if reasons and drain:
            try:  # before anything is written: a router that does not answer changes nothing
                result["drain"] = router_drain.take_out(drain["router_url"], drain["worker_url"],
                                                        float(drain.get("timeout_s", 60)),
                                                        drain.get("on_timeout", "abort"))
            except router_drain.DrainAborted as exc:
                result["drain"] = dict(exc.result, summary=router_drain.describe(exc.result))
                self.module.fail_json(msg=f"vllm_change: drain aborted: {exc}; nothing was changed (set "
                                          "vllm_service_drain_on_timeout=proceed to restart anyway and cut them)",
                                      **{k: v for k, v in result.items() if k != "diff"})
            except router_drain.DrainError as exc:
                self.module.fail_json(msg=f"vllm_change: could not take {drain['worker_url']} out of the router "
                                          f"({exc}); nothing was changed", **{k: v for k, v in result.items()
                                                                              if k != "diff"})
            result["drain"]["summary"] = router_drain.describe(result["drain"])
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
                if not result["reset_failed"]:
                    # A change's restart is not a crash: the unit's start limit (5 starts in 10 min) is
                    # there for crash loops, and counts every start. Without this, a sixth change within
                    # ten minutes (key rotations in a row did it in the lab) is refused by systemd
                    # ("start request repeated too quickly"). reset-failed zeroes that counter.
                    self.systemctl("reset-failed", self.unit, check=False)
                since = time.time()
                if self.pointer_changed():
                    # Stop, switch, start: the old process never imports from the new venv.
                    self.systemctl("stop", self.unit)
                    self.pointer_switched = True
                    self.switch_pointer(self.pointer_after)
                    self.systemctl("start", self.unit)
                else:
                    self.systemctl("restart", self.unit)
                result["restarted"] = True
                rollout = self.gate(self.params["record"], since)
            else:
                rollout = self.gate(self.params["record"], None)  # every run proves the server serves
            result["rollout"] = rollout
            if not rollout.get("ok"):
                raise ChangeFailed(str(rollout.get("reason")))
        except Exception as exc:  # noqa: BLE001 - any failure after the drain is undone, router membership too
            self.undo(str(exc) if isinstance(exc, (ChangeFailed, OSError, RuntimeError))
                      else f"{type(exc).__name__}: {exc}", state, result)
        if drain:  # serving: in the router, also when an earlier failure had left it out
            try:
                taken = result.setdefault("drain", {})
                taken.update(router_drain.ensure_listed(drain["router_url"], drain["worker_url"]))
                if taken.get("added") and not taken.get("was_listed"):
                    taken["summary"] = "; ".join(filter(None, [taken.get("summary"), "added to the router "
                                                               "(it was not listed)"]))
            except router_drain.DrainError as exc:
                self.module.fail_json(msg=f"vllm_change: serving with the new configuration, but not back in "
                                          f"the router: {exc}", **{k: v for k, v in result.items() if k != "diff"})
        self.write_stamp()
        for path, spec in self.files.items():
            self.prune_backups(path, spec["secret"])
        for path in self.params["watch"]:  # other roles' files the unit reads: bounded too
            self.prune_backups(path, secret=False)
        self.save_history()
        # Only now, after the gate passed: older venvs go.
        result["removed_venvs"] = self.retention(self.state(), dry_run=False)
        return dict(result, changed=bool(changed or result["restarted"] or enable or result["removed_venvs"]))

    # ---------------------------------------------------------------- history and retention
    def history_entry(self) -> dict:
        files = [{"path": p, "content": f["content"].decode(), "mode": f"{f['mode']:04o}"}
                 for p, f in self.files.items() if not f["secret"] and p != self.params["record_path"]]
        return {"files": files, "record": self.params["record"], "pointer_target": self.pointer_after}

    def save_history(self) -> None:
        entry = self.history_entry()
        history = load_history(self.params["history_file"])
        if history and {k: history[-1].get(k) for k in entry} == entry:
            return
        history = [*history, dict(entry, saved=time.strftime("%Y-%m-%dT%H:%M:%S%z"))][-HISTORY_KEPT:]
        self.write(self.params["history_file"], (json.dumps(history, indent=1) + "\n").encode(), 0o600)

    def retention(self, state: dict[str, str], dry_run: bool) -> list[str]:
        venvs_dir = self.params["venvs_dir"]
        if not venvs_dir or not self.pointer:
            return []
        protected = {self.pointer_after or ""}
        pid = int(state.get("MainPID", "0") or 0)
        if pid > 0:
            with contextlib.suppress(OSError):
                protected.add(venv_store.venv_of_process(pid, venvs_dir) or "")
        history = load_history(self.params["history_file"])
        recent = [self.pointer_after or ""] + [e.get("pointer_target") or "" for e in reversed(history)]
        doomed = venv_store.venvs_to_remove(venvs_dir, self.params["keep_venvs"], protected, recent)
        if not dry_run:
            for path in doomed:
                venv_store.remove_venv(path)
        return doomed

    def undo(self, reason: str, state_before: dict[str, str], result: dict) -> None:
        journal = unit_inputs.journal_tail(self.unit)
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
        serving_again = False  # the undo's own evidence: the router gets the unit back only then
        try:
            self.systemctl("daemon-reload")
            if self.pointer_switched:  # the failed new server stops before the previous venv comes back
                self.systemctl("stop", self.unit, check=False)
                self.switch_pointer(self.pointer_before)
                restored.append(f"{self.pointer} -> {self.pointer_before or '(removed: it did not exist)'}")
            self.systemctl("reset-failed", self.unit, check=False)
            was_serving = state_before.get("ActiveState") == "active" and self.before[self.unit_path] is not None
            if was_serving and (self.written or self.pointer_switched):
                since = time.time()
                self.systemctl("restart", self.unit)
                previous = self.record_of(self.before[self.params["record_path"]])
                back = self.gate(previous, since)
                serving_again = bool(back.get("ok"))
                notes.append(f"previous configuration restarted; serving again on {previous.get('base_url')}: "
                             + ("yes" if back.get("ok") else f"NO ({back.get('reason')})"))
            elif was_serving and not result["restarted"]:
                serving_again = True
                notes.append("nothing had been written, so the running server was left as it was")
            elif was_serving:
                notes.append("nothing had been written; the server was restarted on its own inputs and did not serve")
            else:
                self.systemctl("stop", self.unit, check=False)
                notes.append(f"{self.unit} was not serving before this change; it is stopped")
        except (ChangeFailed, OSError, RuntimeError) as exc:
            notes.append(f"the undo itself failed: {exc}")
        notes += self.router_after_undo(result, serving_again)
        what = (f"the new configuration did not serve: {reason}. Restored {len(restored)} input(s) to their "
                f"previous content: {', '.join(restored)}." if self.written or self.pointer_switched
                else f"the server does not serve, and this run changed nothing: {reason}.")
        self.module.fail_json(
            msg=(f"vllm_change: {what} " + " ".join(notes)
                 + (f" {result['reset_failed']}." if result["reset_failed"] else "")
                 + "\nJournal tail:\n" + "\n".join(journal[-15:])),
            restored=restored, journal=journal[-40:], **{k: v for k, v in result.items() if k != "diff"})

    def router_after_undo(self, result: dict, serving_again: bool) -> list[str]:
        """The router membership is part of what an undo restores: back in when the unit serves again,
        out (and said, verify RTR-001 fails) when it does not."""
        drain, taken = self.params["drain"] or {}, result.setdefault("drain", {})
        if not drain:
            return []
        where = f"{drain['worker_url']} in the router {drain['router_url']}"
        if not serving_again:
            if not taken.get("was_listed"):
                return []
            taken["listed"] = False
            return [f"NOT back {where}: it does not serve (the other workers keep serving; verify RTR-001 "
                    "fails until a converge or a rollback has it serving and puts it back)."]
        try:
            taken.update(router_drain.ensure_listed(drain["router_url"], drain["worker_url"]))
        except router_drain.DrainError as exc:
            taken["listed"] = False
            return [f"serving again but NOT back {where}: {exc} (verify RTR-001 fails until it is)."]
        return [] if taken.get("router") == "not running" else [f"back {where}: yes."]


HISTORY_KEPT = 10


def load_history(path: str) -> list[dict]:
    try:
        with open(path, encoding="utf-8") as handle:
            data = json.load(handle)
    except (OSError, ValueError):
        return []
    if not isinstance(data, list):
        return []
    return [e for e in data if isinstance(e, dict) and isinstance(e.get("files"), list)]


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


ARGUMENT_SPEC = {
    "unit": {"type": "str", "required": True},
    "files": {"type": "list", "elements": "dict", "default": []},
    "mode": {"type": "str", "choices": ["converge", "rollback"], "default": "converge"},
    "pointer": {"type": "path", "default": ""},
    "pointer_target": {"type": "path", "default": ""},
    "venvs_dir": {"type": "path", "default": ""},
    "keep_venvs": {"type": "int", "default": 2},
    "history_file": {"type": "path", "default": "/var/lib/gptoss/vllm-history.json"},
    "api_key": {"type": "str", "default": "", "no_log": True},
    "secrets_file": {"type": "path", "required": True},
    "watch": {"type": "list", "elements": "path", "default": []},
    "record_path": {"type": "path", "required": True},
    "record": {"type": "dict", "default": {}},
    "gate_python": {"type": "path", "default": "/usr/bin/python3"},
    "gate_lib_dir": {"type": "path", "default": "/opt/gptoss/lib"},
    "gate_timeout_s": {"type": "int", "default": 900},
    "stamp_file": {"type": "path", "default": "/var/lib/gptoss/vllm-started.json"},
    "keep_backups": {"type": "int", "default": 3},
    "min_free_mb": {"type": "int", "default": 16},
    "lock_file": {"type": "path", "default": "/run/gptoss/change.lock"},
    "lock_wait_s": {"type": "int", "default": 1200},
    "holder": {"type": "str", "default": "converge"},
    # Replica instances behind a router: take the unit out before the change, put it back after the gate.
    "drain": {"type": "dict", "default": {}},
}


def main() -> None:
    module = AnsibleModule(
        argument_spec=ARGUMENT_SPEC,
        supports_check_mode=True,
    )
    try:
        unit_inputs.secrets_file_text(module.params["api_key"])
    except ValueError as exc:  # refused before the lock and before anything is read or written
        module.fail_json(msg=f"{exc}; nothing was changed")
    on_timeout = (module.params["drain"] or {}).get("on_timeout", "abort")
    if on_timeout not in router_drain.ON_TIMEOUT:
        module.fail_json(msg=f"drain.on_timeout: {on_timeout!r} is not one of {', '.join(router_drain.ON_TIMEOUT)}; "
                             "nothing was changed")
    if module.params["mode"] == "converge" and not (module.params["files"] and module.params["record"]):
        module.fail_json(msg="mode=converge needs files and record; nothing was changed")
    if module.check_mode:
        result = Transaction(module).apply()
    else:
        with change_lock(module) as lock:
            result = dict(Transaction(module).apply(), **lock)
    diff = result.pop("diff")
    module.exit_json(diff=diff if module._diff else None, **result)


if __name__ == "__main__":
    main()
