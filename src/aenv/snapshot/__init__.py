"""Snapshots: manifests, memory layers, device state, the POSIX repository, and the engine.

The engine's parts publish what happens to pauses and snapshots on the node's `aenv.events`
bus (saved, durable, failed) and the warm pools follow template builds there.
"""
