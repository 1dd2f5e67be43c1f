"""envd: the in-guest daemon speaking the E2B envd protocol (Connect-RPC + HTTP) on port 49983.

This package is copied into guest images as a standalone package, so it must only use relative
imports, the standard library and aiohttp.
"""

# Reported to the SDK (via the control plane) as `envdVersion`. 0.6.4 is the highest version gate
# the e2b 2.63 SDK checks; every feature gated at or below it is implemented here.
ENVD_VERSION = "0.6.4"
ENVD_PORT = 49983  # the one definition: the host's modules import it from here
