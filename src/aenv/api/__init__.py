"""The node's HTTP surface: the E2B-compatible API and the sandbox data-plane proxy."""
