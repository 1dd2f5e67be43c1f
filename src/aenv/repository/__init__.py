"""The repository: committed snapshots, their blobs, aliases, leases and gc.

The contract (`contract.Repository` and its reports), the errors, the names and their
validators and the manifest format are neutral modules; the backends are siblings that
implement the contract (`posix`: a directory; `s3`: an object store, with the chunk format of
on-demand loading in `chunks`), and what both do the same way (alias resolution, lease
liveness, gc's selection, pending marks, staging) is written once in `catalog` and `staging`.
This package is the foundation of snapshots: it imports nothing of aenv but `aenv.clock`.
"""
