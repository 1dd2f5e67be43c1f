"""Header names of the node's API that several packages send or check.

The cluster secret is checked by a node (`aenv.cluster.auth`) and presented by gateways and the
scheduler (`aenv.cluster.client`), and by peers fetching blobs (`aenv.runtime.peers`): it is
named here, below all of them.
"""

CLUSTER_SECRET_HEADER = "X-Aenv-Cluster-Secret"
