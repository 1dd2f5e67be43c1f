"""E2B volumes: named directories on the node, with a token each, mounted into sandboxes.

`store` keeps them (`<home>/volumes/<id>/volume.json` and `data/`), `content` is the volume
content API's file operations on a volume's data, and `server` serves a sandbox's mounted
volumes into its network namespace over 9P (diod), for the guest agent to mount.
"""
