"""aenv: agent environments as microVMs with millisecond snapshot, pause, resume and fork."""

__version__ = "0.1.0"
