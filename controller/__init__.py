"""Runs on the controller only (the machine that runs ansible-playbook and invoke).

bench (aiohttp, matplotlib, NVML where the controller has GPUs) and tune's loop; never shipped to a host.
"""
