"""Snapshots: the engine (templates, pause and resume, clones, checkpoints, warm pools, hand-over).

The engine's parts publish what happens to pauses and snapshots on the node's `aenv.events`
bus (saved, durable, failed) and the warm pools follow template builds there.
"""
