"""Snapshots: the engine (templates, pause and resume, clones, checkpoints, warm pools, hand-over)."""
