"""The node's runtime tier: committed snapshots' parts as local files QEMU maps and opens.

The resolvers (`resolvers`, behind `contract.RuntimeResolver`), the bounded blob cache of an
s3 node (`cache`), on-demand loading's FUSE server (`lazyfs`), the peer-to-peer blob transport
(`peers`), the qcow2 layer chains of sandbox disks (`layers`), and the node's storage opened
from its settings (`open`). It sits on `aenv.repository` and `aenv.vmm`, below the snapshot
engine, the orchestrator, the cluster and the API.
"""
