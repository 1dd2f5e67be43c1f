"""Snapshots: manifests, memory layers, device state, the POSIX repository, and the engine."""
