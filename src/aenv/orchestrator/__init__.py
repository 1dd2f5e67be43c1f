"""Sandbox lifecycle: the state machine, TTLs, persistence across restarts."""
