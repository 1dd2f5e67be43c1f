#!/bin/sh
# Print a new secrets.env for deploy/compose/compose.yaml: the users' API key, the cluster secret
# and the S3 key pair, random each time:  deploy/compose/secrets.sh > deploy/compose/secrets.env
set -eu
hex() { od -An -N"$1" -tx1 /dev/urandom | tr -d ' \n'; }
echo "AENV_API_KEY=e2b_$(hex 32)"
echo "AENV_CLUSTER_SECRET=$(hex 32)"
echo "AENV_S3_ACCESS_KEY=AK$(hex 10)"
echo "AENV_S3_SECRET_KEY=$(hex 20)"
