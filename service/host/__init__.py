"""Runs on the host's system python3 (stdlib only, plus the collection's module_utils).

verify, preflight, the rollout gate and the readers they share. gptoss_base ships this folder to
every host; verify.yml and preflight.yml ship it to a temp folder of their own.
"""
