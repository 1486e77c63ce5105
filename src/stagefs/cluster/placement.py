"""Placement: which nodes hold which shard. A pure function, computed alike on every node.

No metadata service: every daemon and every training process derives the same table from
(shard count, node count, replicas, the replicate-all shards, seed).

The rule: rendezvous hashing (highest random weight). Every (shard, node) pair has a score;
a shard's *ranking* is every node by falling score, and its K holders are the first K of
its ranking. When nodes die, the shard's live holders are the first K *live* nodes of the
same ranking: the next node of the ranking takes over, and since the next node is a
different one for each shard, a dead node's shards (and their readers) spread over many
nodes, not onto one partner. A shard whose holders are all alive keeps them: placement
changes by the least it can (``live``).

The score: ``fmix32(key(shard) ^ key(node))``, where a shard's key is xxh3 of its index
seeded with the seed (the same hash that ordered shards before) and a node's key is the
32-bit finaliser of its index xor'ed with a seeded constant. The finaliser is a bijection
and node keys are distinct, so one shard's scores are distinct: no ties, no tie-break that
could differ between numpy versions. It is computed with numpy for all shards and nodes at
once (100k shards x 4096 nodes in well under a second), keeping the top ``K + SPARE`` of
each ranking; the rest of a ranking is computed for the one shard that needs it.

The first holder listed is the shard's *primary*: the one node that reads it from the
origin. It is the holder that has been primary least often so far, shards taken in a seeded
order, so origin reads are spread as evenly as the copies allow. Shards named by
``--replicate-all`` go to every node (their primary rotates).
"""

from __future__ import annotations

import fnmatch
from collections.abc import Collection, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
from xxhash import xxh3_64_hexdigest, xxh3_64_intdigest

from stagefs.errors import ConfigError

__all__ = ["SPARE", "Placement", "place", "shards_matching"]

SPARE = 2
"""Nodes of each ranking kept beyond the K holders: the first to take over."""

_M1, _M2 = np.uint32(0x85EBCA6B), np.uint32(0xC2B2AE35)
_ROWS = 256  # shards scored at once: 256 x 4096 scores stay in the cache


def _fmix(x: np.ndarray) -> np.ndarray:
    """murmur3's 32-bit finaliser, in place: a bijection that mixes every bit."""
    x ^= x >> np.uint32(16)
    x *= _M1
    x ^= x >> np.uint32(13)
    x *= _M2
    x ^= x >> np.uint32(16)
    return x


def _shard_keys(seed: int, shards: int) -> np.ndarray:
    s = seed & (2**64 - 1)
    return np.fromiter((xxh3_64_intdigest(i.to_bytes(8, "little"), seed=s) & 0xFFFFFFFF
                        for i in range(shards)), dtype=np.uint32, count=shards)


def _node_keys(seed: int, nodes: int) -> np.ndarray:
    salt = xxh3_64_intdigest(b"node", seed=seed & (2**64 - 1)) & 0xFFFFFFFF
    return _fmix(np.arange(nodes, dtype=np.uint32) ^ np.uint32(salt))


def _top(shard_keys: np.ndarray, node_keys: np.ndarray, r: int) -> np.ndarray:
    """The first ``r`` nodes of every shard's ranking: an (shards, r) int32 array."""
    n = len(node_keys)
    out = np.empty((len(shard_keys), r), dtype=np.int32)
    buf = np.empty((_ROWS, n), dtype=np.uint32)
    for a in range(0, len(shard_keys), _ROWS):
        b = min(len(shard_keys), a + _ROWS)
        m = buf[: b - a]
        np.bitwise_xor(shard_keys[a:b, None], node_keys[None, :], out=m)
        _fmix(m)
        if r >= n:
            out[a:b] = np.argsort(m, axis=1)[:, ::-1][:, :r]
            continue
        rows = np.arange(b - a)
        for j in range(r):  # r argmax passes beat a partition for a few of 4096
            i = m.argmax(axis=1)
            out[a:b, j] = i
            m[rows, i] = 0  # scores are distinct, and r < n: a taken 0 is never the max
    return out


@dataclass(frozen=True, slots=True)
class Placement:
    """The holders of every shard, in order (primary first), and each shard's ranking."""

    nodes: int
    replicas: int
    holders: tuple[tuple[int, ...], ...]  # shard -> nodes, primary first
    seed: int = 0
    everywhere: frozenset[int] = frozenset()
    _top: np.ndarray = field(default_factory=lambda: np.empty((0, 0), np.int32),
                             compare=False, repr=False)
    _keys: tuple[np.ndarray, np.ndarray] | None = field(default=None, compare=False,
                                                        repr=False)

    def settings(self) -> dict[str, Any]:
        """What the placement was computed from, and a key of it, for a daemon's STATUS:
        daemons of one job that were given another ``--replicas``, ``--seed`` or
        ``--replicate-all`` (one restarted with other arguments) place the shards apart,
        and each looks for shards where the others did not put them."""
        every = sorted(self.everywhere)
        key = xxh3_64_hexdigest(repr((self.nodes, self.replicas, self.seed, every)).encode())
        return {"key": key, "nodes": self.nodes, "replicas": self.replicas,
                "seed": self.seed, "everywhere": len(every)}

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

    def ranking(self, shard: int) -> list[int]:
        """Every node, in the shard's order of takeover: its holders first (primary first),
        then the node that takes over when one of them dies, then the next..."""
        h = self.holders[shard]
        if shard in self.everywhere or len(h) == self.nodes:
            return list(h)
        if self._keys is None:  # built by hand (tests): holders, then the rest in order
            return [*h, *(n for n in range(self.nodes) if n not in h)]
        sk, nk = self._keys
        scores = _fmix(sk[shard] ^ nk)
        rest = [int(n) for n in np.argsort(scores)[::-1] if int(n) not in h]
        return [*h, *rest]

    def spares(self) -> list[tuple[int, ...]]:
        """Each shard's ``SPARE`` nodes after its holders in its ranking (none for a shard on
        every node): the first to take it over when a holder dies, and the nodes that hold
        the pieces of it its holders had no room for (cluster/staging.py)."""
        return [() if s in self.everywhere else tuple(self.live(s, (), SPARE)[len(h):])
                for s, h in enumerate(self.holders)]

    def live(self, shard: int, dead: Collection[int], extra: int = 0) -> list[int]:
        """The shard's first ``replicas + extra`` nodes of its ranking that are not
        ``dead``: its live holders (with no one dead, exactly ``holders``), then the nodes
        that take over next. Never more than the live nodes."""
        want = len(self.holders[shard]) + extra
        h = self.holders[shard]
        if not dead and extra == 0:
            return list(h)
        top = self._top[shard] if len(self._top) else ()
        prefix = [*h, *(int(n) for n in top if int(n) not in h)]
        out = [n for n in prefix if n not in dead][:want]
        if len(out) < want and len(prefix) < self.nodes:
            out = [n for n in self.ranking(shard) if n not in dead][:want]
        return out


def _primaries(tops: np.ndarray, k: int, order: Sequence[int], nodes: int
               ) -> list[tuple[int, ...]]:
    """Each shard's holders, primary first: the holder with the fewest primaries so far,
    shards taken in ``order`` (the others follow in ranking order)."""
    holders: list[tuple[int, ...]] = [()] * len(tops)
    block = tops[:, :k].tolist()
    primaries = [0] * nodes
    for s in order:
        b = block[s]
        first = min(range(k), key=lambda r: (primaries[b[r]], r))
        primaries[b[first]] += 1
        holders[s] = (b[first], *b[:first], *b[first + 1:])
    return holders


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
    if nodes >= 2**31:
        raise ConfigError(f"too many nodes ({nodes})")
    k = min(replicas, nodes)
    every = frozenset(s for s in everywhere if 0 <= s < shards)
    sk, nk = _shard_keys(seed, shards), _node_keys(seed, nodes)
    tops = _top(sk, nk, min(nodes, k + SPARE))
    # the seeded shard order (as before): which shard picks its primary first
    order = [s for s in np.lexsort((np.arange(shards), _order_keys(seed, shards))).tolist()
             if s not in every]
    holders = _primaries(tops, k, order, nodes)
    start = seed % nodes
    for s in every:
        # the primary rotates so that origin reads of these shards are spread too
        first = (start + s) % nodes
        holders[s] = tuple((first + r) % nodes for r in range(nodes))
    return Placement(nodes, k, tuple(holders), seed, every, tops, (sk, nk))


def _order_keys(seed: int, shards: int) -> np.ndarray:
    s = (seed ^ 0x9E3779B97F4A7C15) & (2**64 - 1)
    return np.fromiter((xxh3_64_intdigest(i.to_bytes(8, "little"), seed=s)
                        for i in range(shards)), dtype=np.uint64, count=shards)


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
