"""Where shard bytes come from: node-local tiers and the origin, behind one small protocol."""

from stagefs.tiers.base import OriginStats, ShardSource, SourceUnavailable
from stagefs.tiers.origin import PackOrigin

__all__ = ["OriginStats", "PackOrigin", "ShardSource", "SourceUnavailable"]
