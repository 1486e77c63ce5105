"""Cluster mode: placement, world discovery, the per-node daemon, connect()."""
