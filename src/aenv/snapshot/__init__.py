"""Snapshots: memory layers, device state, committed snapshot repository and catalog."""
