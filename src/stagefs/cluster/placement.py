"""Placement: which nodes hold which shard. A pure function, computed alike on every node.

No metadata service: every daemon and every training process derives the same table from
(shard count, node count, replicas, the replicate-all shards, seed).

The rule. Shards are put in a seeded pseudo-random order (xxh3 of seed and index, so the
order does not depend on the numpy or Python version). The j-th shard of that order goes to
the K consecutive nodes ``(j*K + r) mod N`` for r in 0..K-1: the K copies are on distinct
nodes (K <= N), and the S*K copies are dealt round-robin, so every node gets S*K // N or
one more. Shards named by ``--replicate-all`` go to every node, which adds the same count to
each. The first holder listed is the shard's *primary*: the one node that reads it from the
origin; it is the node of the K that has been primary least often so far, so that origin
reads are spread as evenly as the copies.
"""

from __future__ import annotations

import fnmatch
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from xxhash import xxh3_64_intdigest

from stagefs.errors import ConfigError

__all__ = ["Placement", "place", "shards_matching"]


@dataclass(frozen=True, slots=True)
class Placement:
    """The holders of every shard, in order (primary first)."""

    nodes: int
    replicas: int
    holders: tuple[tuple[int, ...], ...]  # shard -> nodes, primary first

    def shards_of(self, node: int) -> list[int]:
        """The shards placed on ``node``, in shard order."""
        return [s for s, h in enumerate(self.holders) if node in h]

    def primary_shards(self, node: int) -> list[int]:
        return [s for s, h in enumerate(self.holders) if h[0] == node]

    def counts(self) -> list[int]:
        out = [0] * self.nodes
        for h in self.holders:
            for n in h:
                out[n] += 1
        return out


def _order_key(seed: int, shard: int) -> tuple[int, int]:
    return xxh3_64_intdigest(shard.to_bytes(8, "little"), seed=seed & (2**64 - 1)), shard


def place(shards: int, nodes: int, replicas: int = 1, *, everywhere: Iterable[int] = (),
          seed: int = 0) -> Placement:
    """Place ``shards`` shards on ``nodes`` nodes with ``replicas`` copies each.

    ``replicas`` larger than ``nodes`` is capped at ``nodes`` (a node holds one copy at most).
    Shards in ``everywhere`` are placed on every node.
    """
    if nodes < 1:
        raise ConfigError(f"a cluster needs at least one node (got {nodes})")
    if shards < 0:
        raise ConfigError(f"shard count must not be negative (got {shards})")
    if replicas < 1:
        raise ConfigError(f"--replicas must be at least 1 (got {replicas})")
    k = min(replicas, nodes)
    every = {s for s in everywhere if 0 <= s < shards}
    rest = sorted((s for s in range(shards) if s not in every), key=lambda s: _order_key(seed, s))
    start = seed % nodes
    holders: list[tuple[int, ...]] = [()] * shards
    primaries = [0] * nodes
    for j, s in enumerate(rest):
        block = [(start + j * k + r) % nodes for r in range(k)]
        # the primary is the block's node with the fewest primaries so far: origin reads
        # are spread as evenly as the copies (a fixed first slot would leave nodes out)
        first = min(range(k), key=lambda r: (primaries[block[r]], r))
        primaries[block[first]] += 1
        holders[s] = (block[first], *block[:first], *block[first + 1 :])
    for s in every:
        # the primary rotates so that origin reads of these shards are spread too
        first = (start + s) % nodes
        holders[s] = tuple((first + r) % nodes for r in range(nodes))
    return Placement(nodes, k, tuple(holders))


def shards_matching(paths: Iterable[tuple[str, int]], globs: Sequence[str]) -> set[int]:
    """Shards holding any file whose path, or one of its parent directories, matches a glob.

    ``paths`` yields (relative path, shard) for every file. A glob such as ``val`` or
    ``val/*`` names the subtree; ``*.json`` any JSON file at any depth is ``**/*.json`` or
    ``*.json`` (fnmatch's ``*`` crosses ``/``).
    """
    pats = [g.strip("/") for g in globs if g.strip("/")]
    if not pats:
        return set()
    out: set[int] = set()
    for path, shard in paths:
        if shard in out:
            continue
        parts = path.split("/")
        prefixes = ("/".join(parts[: i + 1]) for i in range(len(parts)))
        if any(fnmatch.fnmatchcase(p, g) for p in prefixes for g in pats):
            out.add(shard)
    return out
