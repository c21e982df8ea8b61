"""How one push's buckets reach every receiver: down a tree rooted at the trainer.

`star`: the trainer writes every bucket to every receiver (its egress is N x the model). `chain` and
`tree` (fan-out f): the trainer writes each bucket once, to the first receiver, and every receiver
that has verified a bucket writes it on to its children from its staging slot (`apply` with
`forward`), so the trainer's egress stays ~1x the model whatever the fleet; a chain is a tree of
fan-out 1. Every hop checks the digest of what it copied. A tree's fan-out is chosen per push unless
set (`best_fan_out`): where every host has one link of the same speed, a relay with f children
sends every byte f times over it, so a chain is fastest until the fleet is deep compared with the
number of buckets, and wider trees only past that.

Pipelined: bucket k moves down the tree while k+1 follows it. Slot j of a receiver holds bucket k
from the moment k is written into it until its subtree has verified k; the trainer's local slot
holds k until the whole tree has. A receiver's slot j goes to buckets j, j + n, j + 2n, ... in that
order (`Turns`), so bucket k waits only on bucket k - n, never on a later one: no two buckets wait on
each other in a cycle, however their writes to sibling receivers interleave.

Failures: a bucket whose digest fails at a receiver is written into it again by the trainer (its
local slot still holds the bucket) and retried. A receiver that fails (timed out, unreachable,
digests that stay wrong) is dropped when the fleet may shrink (`Hop.drop` raises otherwise); its
children are then fed by its nearest live ancestor, which sends them the buckets in flight from the
trainer and relays every later one.
"""
from __future__ import annotations

import logging
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Callable

from weight_sync.clients import ReceiverCallError
from weight_sync.protocol import ApplyRequest, ErrorKind, Target, UpdateRef

log = logging.getLogger(__name__)
TRAINER = -1
TOPOLOGIES = ("star", "chain", "tree")


AUTO = 0      # tree fan-out chosen per push from the fleet size and the bucket count (best_fan_out)


def tree_parents(n: int, topology: str, fan_out: int = AUTO, buckets: int = 1) -> list[int]:
    """The parent of each of n receivers (TRAINER for the trainer's own children)."""
    if topology == "star":
        return [TRAINER] * n
    if topology not in TOPOLOGIES:
        raise ValueError(f"weight_sync.topology={topology!r}: use one of {TOPOLOGIES}")
    if fan_out < 0:
        raise ValueError(f"weight_sync.fan_out={fan_out}: must be >= 1, or {AUTO} to choose it per push")
    f = 1 if topology == "chain" else fan_out or best_fan_out(n, buckets)
    return [TRAINER] + [(i - 1) // f for i in range(1, n)]


def levels(n: int, f: int) -> int:
    """How many receivers deep a tree of n with fan-out f is (the trainer feeds its root)."""
    if f == 1:
        return n
    depth, width, placed = 0, 1, 0
    while placed < n:
        placed, width, depth = placed + width, width * f, depth + 1
    return depth


def best_fan_out(n: int, buckets: int) -> int:
    """The fan-out that moves `buckets` buckets to n receivers soonest when every host's link is as
    fast as every other's: a receiver with f children writes each bucket f times over its one link,
    so the last bucket lands after about f * (buckets + levels - 1) bucket-times. Few receivers or
    many buckets: a chain (f = 1, every link busy with one copy); many receivers: wider."""
    return min(range(1, max(2, n)), key=lambda f: (f * (buckets + levels(n, f) - 1), f))


def depth(parents: list[int]) -> int:
    """Receivers on the longest path from the trainer (1 for a star)."""
    def up(i: int) -> int:
        return 1 if parents[i] == TRAINER else 1 + up(parents[i])
    return max((up(i) for i in range(len(parents))), default=1)


@dataclass
class Hop:
    """What the fan-out needs of the sender."""
    write: Callable[[object, int, int, int], None]     # (peer, local slot, bucket k, nbytes): trainer -> peer
    drop: Callable[[object, Exception], None]          # raises when the update cannot go on without it
    timeout_s: float
    max_retries: int


class Turns:
    """Slot k % n of every receiver, handed to bucket k only once bucket k - n is done with it there.
    A bucket that took a slot and must be sent again from elsewhere (its relay failed) puts it back
    untouched; `done` moves the slot on to bucket k + n."""

    def __init__(self, receivers: int, n: int):
        self.n = n
        self._next = [list(range(n)) for _ in range(receivers)]
        self._held = [[False] * n for _ in range(receivers)]
        self._cv = threading.Condition()

    def take(self, node: int, k: int, give_up: Callable[[], bool]) -> bool:
        """Wait for the turn of bucket k at node's slot; False when `give_up()` says to stop waiting."""
        j = k % self.n
        with self._cv:
            while self._held[node][j] or self._next[node][j] < k:
                if give_up():
                    return False
                self._cv.wait(0.05)
            if self._next[node][j] > k:          # through node already: nothing to take
                return False
            self._held[node][j] = True
            return True

    def give(self, node: int, k: int, done: bool) -> None:
        j = k % self.n
        with self._cv:
            self._held[node][j] = False
            if done:
                self._next[node][j] = k + self.n
            self._cv.notify_all()

    def has(self, node: int, k: int) -> bool:
        """Bucket k is through node already."""
        return self._next[node][k % self.n] > k


class Links:
    """One write at a time into each receiver, lowest bucket first: writes that share a link only
    share its bandwidth, so running them together delays every bucket and the pipeline behind it."""

    def __init__(self, receivers: int):
        self._busy = [False] * receivers
        self._waiting: list[set[int]] = [set() for _ in range(receivers)]
        self._cv = threading.Condition()

    def write(self, node: int, k: int, fn: Callable[[], None]) -> None:
        with self._cv:
            self._waiting[node].add(k)
            while self._busy[node] or min(self._waiting[node]) != k:
                self._cv.wait()
            self._waiting[node].discard(k)
            self._busy[node] = True
        try:
            fn()
        finally:
            with self._cv:
                self._busy[node] = False
                self._cv.notify_all()


class Fanout:
    def __init__(self, peers: list, parent: list[int], num_slots: int, ring: int, ref: UpdateRef, hop: Hop,
                 pool: ThreadPoolExecutor):
        self.peers, self.parent, self.ref, self.hop, self.pool = peers, parent, ref, hop, pool
        self.num_slots, self.ring = num_slots, ring
        self.turns = Turns(len(peers), num_slots)
        self.links = Links(len(peers))
        self.local = [threading.Semaphore(1) for _ in range(ring)]
        self._nbytes: dict[int, int] = {}
        self._extra: dict[int, dict] = {}           # bucket -> its encoding's apply fields (delta)
        self._lock = threading.Lock()
        self.failed: BaseException | None = None     # the error that ends the update: every wait gives up
        self.egress_bytes = 0
        self.apply_s = 0.0
        self.retries = 0

    def children(self, node: int) -> list[int]:
        """Live receivers whose nearest live ancestor is `node` (a dropped receiver's children
        belong to its parent)."""
        out = []
        for i in range(len(self.peers)):
            if self.peers[i].error is not None:
                continue
            up = self.parent[i]
            while up != TRAINER and self.peers[up].error is not None:
                up = self.parent[up]
            if up == node:
                out.append(i)
        return out

    def take_local(self, k: int) -> int:
        """Wait until local slot k % ring is free: bucket k - ring has reached every receiver."""
        self._acquire(self.local[k % self.ring])
        return k % self.ring

    def bucket(self, k: int, nbytes: int, digest: str, extra: dict | None = None) -> None:
        """Bucket k, packed in local slot k % ring (`nbytes` of it), to every live receiver; returns
        once each has verified it. `extra`: the apply fields of its encoding (a delta's). A failure
        that ends the update is raised, and every other wait gives up."""
        self._nbytes[k], self._extra[k] = nbytes, extra or {}
        try:
            self._serve(TRAINER, k, digest, sent=[])
        except BaseException as e:
            self.failed = self.failed or e
            raise
        finally:
            self.local[k % self.ring].release()

    def _acquire(self, slot: threading.Semaphore) -> None:
        while not slot.acquire(timeout=0.05):
            if self.failed is not None:
                raise self.failed

    def _take(self, node: int, k: int) -> bool:
        """Node's slot for bucket k; False when node was dropped while waiting (or has k already)."""
        if not self.turns.take(node, k, lambda: self.failed is not None or self.peers[node].error is not None):
            if self.failed is not None:
                raise self.failed
            return False
        return True

    # ---- one bucket down the tree ------------------------------------------------------------------
    def _serve(self, node: int, k: int, digest: str, sent: list[int]) -> None:
        """`node` holds bucket k verified (the trainer: in its ring) and wrote it already into `sent`.
        Every child of node gets it, verifies it and serves its own children; a child dropped on the
        way leaves its children to node, served in the next round."""
        served: set[int] = set()
        while kids := [c for c in dict.fromkeys(sent + self.children(node))
                       if c not in served and self.peers[c].error is None and not self.turns.has(c, k)]:
            served.update(kids)
            self._each(lambda c: self._send(c, k), [c for c in kids if c not in sent])
            sent = []
            self._each(lambda c: self._visit(c, k, digest),
                       [c for c in kids if self.peers[c].error is None and not self.turns.has(c, k)])

    def _visit(self, node: int, k: int, digest: str) -> None:
        """Bucket k has been written into node's slot: verify it there, write it on to node's
        children, let them do the same. Node's slot goes on to bucket k + n as soon as its own
        copy and its writes to its children are done: a child whose copy fails is written again by
        the trainer (whose ring holds k until the whole tree has it), never from node's slot, so
        the next bucket can come down while k travels further."""
        unwritten, held = [], True
        try:
            kids = unwritten = [c for c in self.children(node) if self._take(c, k)]
            try:
                failed = self._apply(node, k, digest, kids)
            except ReceiverCallError as e:
                self._drop(node, e)         # its children are its parent's now: served there
                return
            unwritten, held = [], False     # written: each kid's own visit hands its slot on
            self.turns.give(node, k, done=True)
            for i, error in failed.items():
                self._drop(kids[i], ReceiverCallError(self.peers[kids[i]].name, f"relay write failed: {error}"))
            self._serve(node, k, digest, sent=[c for i, c in enumerate(kids) if i not in failed])
        finally:
            for c in unwritten:             # the slot waits for bucket k from elsewhere
                self.turns.give(c, k, done=False)
            if held:
                self.turns.give(node, k, done=False)

    def _apply(self, node: int, k: int, digest: str, kids: list[int]) -> dict[int, str]:
        """Bucket k at node, forwarded to `kids`; a digest mismatch is written again from the
        trainer and retried. Returns the forward writes that failed, by index in kids."""
        j = k % self.num_slots
        targets = [Target(session=self.peers[c].reply.session, addr=self.peers[c].reply.slot_addrs[j]) for c in kids]
        req = ApplyRequest(**self.ref.model_dump(), bucket=k, slot=j, digest=digest, forward=targets,
                           forward_timeout_s=self.hop.timeout_s, **self._extra[k])
        for attempt in range(self.hop.max_retries + 1):
            t = time.perf_counter()
            try:
                reply = self.peers[node].client.apply(req)
            except ReceiverCallError as e:
                if e.kind is not ErrorKind.DIGEST or attempt == self.hop.max_retries:
                    raise
                log.warning("%s; sending bucket %d again (attempt %d)", e, k, attempt + 1)
                with self._lock:
                    self.retries += 1
                self.hop.write(self.peers[node], k % self.ring, k, self._nbytes[k])
                self._count(self._nbytes[k])
                continue
            with self._lock:
                self.apply_s += time.perf_counter() - t
            return reply.failed
        raise AssertionError("unreachable")

    def _send(self, node: int, k: int) -> None:
        """The trainer writes bucket k into node's slot (once the slot is free); node is dropped
        when that fails."""
        if not self._take(node, k):
            return
        try:
            self.links.write(node, k, lambda: self.hop.write(self.peers[node], k % self.ring, k, self._nbytes[k]))
        except ReceiverCallError as e:
            self.turns.give(node, k, done=False)
            self._drop(node, e)
            return
        self._count(self._nbytes[k])

    def _count(self, nbytes: int) -> None:
        with self._lock:
            self.egress_bytes += nbytes

    def _drop(self, node: int, error: Exception) -> None:
        with self._lock:
            if self.peers[node].error is not None:
                return
        self.hop.drop(self.peers[node], error)

    def _each(self, fn, nodes: list[int]) -> None:
        """fn(node) for every node, in parallel; the first error that ends the update is raised."""
        if len(nodes) <= 1:
            for n in nodes:
                fn(n)
            return
        for f in [self.pool.submit(fn, n) for n in nodes]:
            f.result()

    @staticmethod
    def pool_size(receivers: int, ring: int) -> int:
        """Threads enough that no task waits for a thread held by a task that waits on it: per
        bucket in flight, its own task plus a send and a visit per receiver."""
        return ring * (2 * receivers + 1) + 2
