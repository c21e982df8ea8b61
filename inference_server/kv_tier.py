"""The KV cache's second tier: prefix-cache blocks evicted from the pool, kept in host memory.

The paged pool (kv_cache.PagedKVCache) keeps a finished sequence's full blocks cached until it needs
the room; under many concurrent multi-turn episodes they are evicted while a tool runs, and the next
turn would prefill its whole context again. With a host tier (`--kv-host-gb`), an evicted cached
block's keys and values are copied out first, keyed as the prefix cache keys them (the chain hash of
its tokens and all before them, checked against the chain hash before it and its own tokens) and by
the weights that computed them (the pool's epoch); a newcomer whose tokens go on past the blocks the
pool holds finds the next ones here, and they are copied back into fresh pool blocks instead of
computed (blocks.BlockAllocator.match). A block's digest (xxh3 of its bytes) is taken when it is
written and checked when it is read: one that fails is dropped and its positions computed, never used.
New weights drop every entry made under others, but those of the pool's kept epochs
(`BlockAllocator.keep_epochs`, for requests that keep old KV: they are asked for by epoch). Least
recently used entries go first when the budget is full.
"""
from __future__ import annotations

import json
import time
from collections import OrderedDict

import torch
import xxhash


class HostTier:
    """`slots` blocks of keys and values in host memory ([slots, 2, layers, kv_heads, block_size,
    head_dim], allocated as they are first written), an LRU index over them, and counters."""

    def __init__(self, budget_bytes: int, kv, blocks):
        self.kv, self.blocks = kv, blocks
        layers, _, heads, size, dim = kv.k.shape
        self.block_bytes = 2 * layers * heads * size * dim * kv.k.element_size()
        self.slots = budget_bytes // self.block_bytes
        if self.slots < 1:
            raise ValueError(f"the host KV tier's budget ({budget_bytes / 2**30:.3g} GiB) holds no block of "
                             f"{self.block_bytes / 2**20:.1f} MiB")
        self.store = torch.empty((self.slots, 2, layers, heads, size, dim), dtype=kv.k.dtype)
        self._free = list(range(self.slots - 1, -1, -1))
        # (chain hash, epoch) -> (slot, chain hash before it, tokens, digest)
        self.entries: OrderedDict[tuple[int, int], tuple[int, int, tuple, int]] = OrderedDict()
        self.stats = {"saved_blocks": 0, "loaded_blocks": 0, "misses": 0, "corrupt_blocks": 0,
                      "loaded_tokens": 0, "load_bytes": 0, "load_seconds": 0.0, "dropped_blocks": 0}

    @property
    def size(self) -> int:
        return len(self.entries)

    def _digest(self, slot: int) -> int:
        return xxhash.xxh3_64_intdigest(self.store[slot].view(torch.uint8).numpy())

    def set_epoch(self, epoch: int | None) -> None:
        """New weights: entries made under others are of no use to a sequence of these (but to one that
        keeps old KV, under the pool's kept epochs)."""
        for key in [key for key in self.entries if key[1] != epoch and not self.blocks._kept(key[1])]:
            self._drop(key)

    def _drop(self, key: tuple[int, int]) -> None:
        self._free.append(self.entries.pop(key)[0])
        self.stats["dropped_blocks"] += 1

    def forget(self, h: int, epoch: int) -> None:
        if (h, epoch) in self.entries:
            self._drop((h, epoch))

    def clear(self) -> None:
        for key in list(self.entries):
            self._drop(key)

    def save(self, block: int, h: int, before: int, chunk: tuple, epoch: int | None) -> None:
        """Pool block `block` (cached as chain hash `h`, made under `epoch`) is about to be reused: keep a copy."""
        if epoch is None:
            return
        key = (h, epoch)
        have = self.entries.get(key)
        if have is not None and have[1:3] == (before, chunk):
            self.entries.move_to_end(key)          # loaded from here earlier: the same keys and values
            return
        if have is not None:
            self._drop(key)
        if not self._free:
            self._drop(next(iter(self.entries)))
        slot = self._free.pop()
        self.store[slot, 0] = self.kv.k[:, block]
        self.store[slot, 1] = self.kv.v[:, block]
        self.entries[key] = (slot, before, chunk, self._digest(slot))
        self.stats["saved_blocks"] += 1

    def has(self, h: int, before: int, chunk: tuple, epoch: int, count: bool = True) -> bool:
        e = self.entries.get((h, epoch))
        if e is not None and e[1:3] == (before, chunk):
            return True
        if count:
            self.stats["misses"] += 1
        return False

    def load(self, h: int, before: int, chunk: tuple, block: int, epoch: int) -> bool:
        """Copy entry (`h`, `epoch`) into pool block `block`; False (and the entry dropped) when its bytes
        no longer match the digest taken when it was written."""
        t = time.perf_counter()
        key = (h, epoch)
        slot, *_, digest = self.entries[key]
        if self._digest(slot) != digest:
            self.stats["corrupt_blocks"] += 1
            self._drop(key)
            return False
        self.kv.k[:, block] = self.store[slot, 0]
        self.kv.v[:, block] = self.store[slot, 1]
        self.entries.move_to_end(key)
        self.stats["loaded_blocks"] += 1
        self.stats["loaded_tokens"] += len(chunk)
        self.stats["load_bytes"] += self.block_bytes
        self.stats["load_seconds"] += time.perf_counter() - t
        return True


class TierChain:
    """The tiers behind the pool, nearest first: `has` and `load` ask each in turn; `save` (a block
    evicted from the pool) goes to the host tier, `publish` (a block just cached in the pool) to the
    store, from where other servers load it."""

    def __init__(self, host: HostTier | None, store: "StoreTier | None"):
        self.host, self.store = host, store
        self.tiers = [t for t in (host, store) if t is not None]

    @property
    def size(self) -> int:
        return sum(t.size for t in self.tiers)

    @property
    def stats(self) -> dict:
        out = dict(self.host.stats) if self.host is not None else {}
        if self.store is not None:
            out.update({f"store_{k}": v for k, v in self.store.stats.items()})
        return out

    def set_epoch(self, epoch) -> None:
        for t in self.tiers:
            t.set_epoch(epoch)

    def save(self, block: int, h: int, before: int, chunk: tuple, epoch: int | None) -> None:
        if self.host is not None:
            self.host.save(block, h, before, chunk, epoch)

    def forget(self, h: int, epoch: int) -> None:
        """An ended episode's block: its host entry goes (the store's stay: other servers may want them)."""
        if self.host is not None:
            self.host.forget(h, epoch)

    def clear(self) -> None:
        if self.host is not None:
            self.host.clear()

    def publish(self, block: int, h: int, before: int, chunk: tuple) -> None:
        if self.store is not None:
            self.store.publish(block, h, before, chunk)

    def has(self, h: int, before: int, chunk: tuple, epoch: int) -> bool:
        return any(t.has(h, before, chunk, epoch) for t in self.tiers)

    def load(self, h: int, before: int, chunk: tuple, block: int, epoch: int) -> bool:
        for t in self.tiers:
            if t.has(h, before, chunk, epoch, count=False):
                return t.load(h, before, chunk, block, epoch)
        return False


class StoreTier:
    """The third level: Mooncake Store (the `mooncake` package's distributed store, one master for the
    fleet), shared by every server of a model. A block the pool caches is published there once (its
    keys and values copied on the engine thread, put by a thread of its own), under a key naming the
    model, the weights' epoch and its chain hash; its value carries the chain hash before it, its tokens
    and a digest, all checked at load. A turn routed to another server (failover, load balancing, a
    partial rollout resumed elsewhere) loads its prefix from here instead of prefilling it."""

    def __init__(self, master: str, metadata: str, kv, blocks, namespace: str, host: str = "127.0.0.1",
                 segment_bytes: int = 1 << 30):
        import queue
        import threading
        from mooncake.store import MooncakeDistributedStore
        self.kv, self.blocks, self.namespace = kv, blocks, namespace
        self.client = MooncakeDistributedStore()
        rc = self.client.setup(host, metadata, segment_bytes, 64 << 20, "tcp", "", master)
        if rc != 0:
            raise RuntimeError(f"Mooncake Store at master {master} (metadata {metadata}) refused this server: setup "
                               f"returned {rc}")
        self.published: set[str] = set()
        self.stats = {"published_blocks": 0, "loaded_blocks": 0, "misses": 0, "corrupt_blocks": 0,
                      "loaded_tokens": 0, "load_bytes": 0, "load_seconds": 0.0, "put_failures": 0}
        self.size = 1                                  # unknown: always worth asking
        self._puts: queue.SimpleQueue = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._put_loop, name="kv-store-put", daemon=True)
        self._thread.start()

    def _key(self, h: int, epoch) -> str:
        return f"{self.namespace}/{epoch}/{h & 0xFFFFFFFFFFFFFFFF:016x}"

    def set_epoch(self, epoch) -> None:
        self.published.clear()

    def publish(self, block: int, h: int, before: int, chunk: tuple) -> None:
        epoch = self.blocks.epoch
        key = self._key(h, epoch)
        if epoch is None or key in self.published:
            return
        self.published.add(key)
        data = torch.stack([self.kv.k[:, block], self.kv.v[:, block]]).contiguous().view(torch.uint8).numpy().tobytes()
        header = json.dumps({"before": before, "chunk": list(chunk), "digest": xxhash.xxh3_64_intdigest(data)}).encode()
        self._puts.put((key, len(header).to_bytes(4, "little") + header + data))

    def _put_loop(self) -> None:
        while True:
            item = self._puts.get()
            if item is None:
                return
            key, value = item
            if self.client.put(key, value) == 0:
                self.stats["published_blocks"] += 1
            else:
                self.stats["put_failures"] += 1

    def has(self, h: int, before: int, chunk: tuple, epoch: int, count: bool = True) -> bool:
        ok = epoch is not None and self.client.is_exist(self._key(h, epoch)) == 1
        if not ok and count:
            self.stats["misses"] += 1
        return ok

    def load(self, h: int, before: int, chunk: tuple, block: int, epoch: int) -> bool:
        t = time.perf_counter()
        value = self.client.get(self._key(h, epoch))
        if not value or len(value) < 4:
            return False
        n = int.from_bytes(value[:4], "little")
        try:
            header = json.loads(value[4:4 + n])
        except ValueError:
            header = {}
        data = value[4 + n:]
        shape = (2, *self.kv.k[:, block].shape)
        if (header.get("before") != before or tuple(header.get("chunk", ())) != chunk
                or header.get("digest") != xxhash.xxh3_64_intdigest(data)
                or len(data) != 2 * self.kv.k[:, block].numel() * self.kv.k.element_size()):
            self.stats["corrupt_blocks"] += 1
            return False
        kv = torch.frombuffer(bytearray(data), dtype=torch.uint8).view(self.kv.k.dtype).view(shape)
        self.kv.k[:, block] = kv[0]
        self.kv.v[:, block] = kv[1]
        self.stats["loaded_blocks"] += 1
        self.stats["loaded_tokens"] += len(chunk)
        self.stats["load_bytes"] += len(data)
        self.stats["load_seconds"] += time.perf_counter() - t
        return True

    def flush(self, timeout: float = 30.0) -> None:
        """Wait until every publish so far is in the store (tests, benches)."""
        deadline = time.monotonic() + timeout
        while not self._puts.empty() and time.monotonic() < deadline:
            time.sleep(0.01)
        time.sleep(0.05)

    def close(self) -> None:
        self._puts.put(None)
        self._thread.join(timeout=10)
        self.client.close()


def _die_with_parent() -> None:
    """In the child before exec (Linux): SIGTERM when the process that started it dies, killed or not."""
    import ctypes
    import signal
    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)      # PR_SET_PDEATHSIG
    except OSError:
        pass


class StoreMaster:
    """A Mooncake Store master (with its HTTP metadata server) on free loopback ports, for a fleet, a
    test or a bench: `address` and `metadata` are what servers take (--kv-store-master,
    --kv-store-metadata). Stopped by `stop()` or on leaving the `with` block, also on an error."""

    def __init__(self, host: str = "127.0.0.1", log_path: str | None = None):
        self.host, self.log_path = host, log_path
        self.proc = None

    def start(self, timeout: float = 30.0) -> "StoreMaster":
        import os
        import shutil
        import socket
        import subprocess
        from pathlib import Path

        import mooncake

        from platforms.process import free_ports
        binary = shutil.which("mooncake_master") or str(Path(mooncake.__file__).parent / "mooncake_master")
        self.rpc, self.http, metrics = free_ports(3, self.host)
        log = open(self.log_path or os.devnull, "w")
        self.proc = subprocess.Popen(preexec_fn=_die_with_parent, args=[binary, f"--rpc_port={self.rpc}", f"--rpc_address={self.host}",
                                      "--enable_http_metadata_server=true", f"--http_metadata_server_host={self.host}",
                                      f"--http_metadata_server_port={self.http}", f"--metrics_port={metrics}",
                                      "--enable_metric_reporting=false"], stdout=log, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"mooncake_master exited with {self.proc.returncode} (log: {self.log_path})")
            try:
                with socket.create_connection((self.host, self.rpc), timeout=0.5), \
                        socket.create_connection((self.host, self.http), timeout=0.5):
                    return self
            except OSError:
                time.sleep(0.1)
        self.stop()
        raise RuntimeError(f"mooncake_master did not listen on {self.host}:{self.rpc} within {timeout}s")

    @property
    def address(self) -> str:
        return f"{self.host}:{self.rpc}"

    @property
    def metadata(self) -> str:
        return f"http://{self.host}:{self.http}/metadata"

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=10)
            except Exception:
                self.proc.kill()
                self.proc.wait()

    def __enter__(self) -> "StoreMaster":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()
