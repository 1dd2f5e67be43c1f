"""The cluster: a scheduler (node registry, placement, sandbox bindings), stateless gateways and
nodes that join them. Shared state lives in Redis; `protocols` is the seam between the parts."""
