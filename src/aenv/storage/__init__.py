"""Disk layers: qcow2 chains shared read-only between sandboxes, one writable layer each."""
