"""What runs inside a sandbox VM: the guest's init (PID 1) and envd, the agent the SDKs talk to.

Nothing here runs on the host in production: `aenv.guest.tools` copies these sources onto the
read-only tools drive every VM mounts, where they run on the guest's Python as standalone code
(only the standard library and the vendored aiohttp). The host imports this package only for
shared protocol facts (`envd.ENVD_VERSION`, `envd.ENVD_PORT`) and to test the agent.
"""
