"""Benchmark harness: figures measured on real VMs, printed as a table and written as JSON."""
