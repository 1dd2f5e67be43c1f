"""The node's sandboxes: the node service (`interface`, `local`) and the orchestrator under it.

`service.Orchestrator` composes one module per job over one table of sandboxes (`sandboxes`,
every state change through `states`): `lifecycle`, `captures`, `recovery`, `handover`,
`history`, `mounting`, `eviction` and `catalog`. Each gets the parts of the engine it uses at
construction and sees the engine only as `backend.SandboxBackend`; `launch` builds what a
sandbox starts with, `ids` names sandboxes and catalog entries.
"""
