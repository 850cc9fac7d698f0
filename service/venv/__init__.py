"""Runs with a product venv's python on the host: it imports what that venv holds.

vllm_flags and convert run in the vLLM venv (vllm, torch), router_launch in the router's venv
(vllm_router). They may import service.host; service.host never imports them.
"""
