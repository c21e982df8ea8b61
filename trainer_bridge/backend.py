"""The attach API: Riptide as the rollout backend of any PyTorch trainer.

    backend = RolloutBackend(cfg)          # servers, rollout manager, weight sync (started lazily)
    backend.start(model)                   # initial weights
    for step in range(steps):
        batch = backend.next_batch()       # a TrainBatch: input_ids, attention_mask, loss_mask, behaviour_logprobs, advantages, ...
        ...                                # the trainer's own forward, loss, optimizer
        backend.push_weights(model, version=step + 1)
    backend.close()

Process layout: the servers are a fleet (fleets/: subprocesses under `cluster=local`, Ray actors in
placement groups of their own under `cluster=ray`); the rollout manager runs in a process of its own
(a subprocess, or a Ray actor), off the trainer's GIL, and this object talks to it by calls that
carry plain data; the weight sender lives here, next to the model it reads.

Fleet membership is kept here. A server that a push drops (dead, frozen, partitioned: it missed the
hop timeout) is evicted: it leaves the router (its requests in flight resume on the others from
their partial tokens) and the weight sync, and it is killed, so it never serves again on old
weights. With `cluster.replace_evicted`, a replacement starts, cold-starts from a live peer, and
joins the pushes at once and the router once it serves the current version. `add_servers` and
`remove_servers` do the same by hand. Every server this object starts, `close()` stops (also on
Ctrl-C or SIGTERM through the context manager, and when the process dies, by the servers' parent-death
signal).
"""
from __future__ import annotations

import asyncio
import dataclasses
import logging
import secrets
import threading
import time
from dataclasses import dataclass, field
from typing import Callable

import httpx
import torch

from rollout.agent import RolloutFn, single_turn
from rollout.client import Generation, RequestRefused, ServerError, client_for
from rollout.config import RolloutConfig, UpdatePolicy
from rollout.data import prompt_ids
from rollout.service import RolloutHost, RolloutSpec
from rollout.tasks import DIGIT_TASKS, dataset_items, digit_items, held_out, reasoning_gym_items
from trainer_bridge.training import grpo, lora
from trainer_bridge.batch import Batch, TrainBatch
from trainer_bridge.config import (BackendConfig, ClusterConfig, JobConfig, ServerConfig, TaskConfig, WeightSyncConfig,
                                   model_context)
from trainer_bridge.fleets import make_fleet, rollout_host
from weight_sync.protocol import InFlight

log = logging.getLogger(__name__)


def at_commit(policy: UpdatePolicy) -> InFlight:
    """rollout.update_policy, the one knob for requests in flight at an update, as the servers apply it
    at a push's commit: abort_all ends every running request with the swap (a manager's come back as
    partial samples and resume on the new weights; a caller without one gets them partial); under
    abort_furthest and continue they run on, and abort_furthest's aborts are the manager's."""
    return InFlight.ABORT if UpdatePolicy(policy) is UpdatePolicy.abort_all else InFlight.CONTINUE


def task_items(task: TaskConfig, seed: int) -> list[dict]:
    """The training items: `{"prompt", "answer", "data_source", "extra_info"}`."""
    if task.name == "dataset":
        return dataset_items(task.path, task.prompt_key, task.answer_key, task.split)
    return generated_items(task, task.num_prompts, seed)


def val_items(task: TaskConfig, seed: int) -> list[dict]:
    """Held-out items in task_items' shape, for validation: task.val_path's; else, for a generated
    task, task.val_size problems drawn with other seeds, none of them a training prompt; else none."""
    if task.val_path:
        return dataset_items(task.val_path, task.prompt_key, task.answer_key, task.val_split, field="task.val_path")
    if task.name == "dataset" or task.val_size == 0:
        return []
    return held_out(lambda count, s: generated_items(task, count, s), task_items(task, seed), task.val_size, seed)


def generated_items(task: TaskConfig, count: int, seed: int) -> list[dict]:
    if task.name in DIGIT_TASKS:
        return digit_items(task.name, task.num_digits, count, seed, task.min_digits)
    if task.name == "reasoning_gym":
        return reasoning_gym_items(task.rg_dataset, task.rg_config, count, seed, task.prompt_template)
    raise ValueError(f"task.name={task.name!r}: use one of {', '.join(DIGIT_TASKS)}, reasoning_gym or dataset")


def check_prompts(items: list[dict], tokenizer, rollout: RolloutConfig, context_length: int) -> None:
    """Before anything starts: every prompt, as the manager will tokenize it, plus max_new_tokens
    must fit the servers' context. Names the longest prompt. A prompt of chat messages without the
    chat template fails here, saying what to change."""
    if not items:
        raise ValueError("the task has no prompts")
    chat = rollout.chat_template(tokenizer)
    prompts = [item["prompt"] for item in items]
    if not chat and all(isinstance(p, str) for p in prompts):   # one batched call: datasets run to many thousand
        lengths = [len(ids) for ids in tokenizer(prompts, add_special_tokens=False).input_ids]
    else:
        if not chat:                     # chat messages without the template: prompt_ids says what to change
            prompt_ids(tokenizer, next(p for p in prompts if not isinstance(p, str)), chat)
        lengths = [len(prompt_ids(tokenizer, p, chat)) for p in prompts[:2000]]
    longest = max(range(len(lengths)), key=lengths.__getitem__)
    if lengths[longest] + rollout.max_new_tokens > context_length:
        raise ValueError(f"rollout.max_new_tokens={rollout.max_new_tokens} + the longest prompt ({lengths[longest]} "
                         f"tokens: {str(prompts[longest])[:60]!r}) is more than "
                         f"server.context_length={context_length}; "
                         f"lower max_new_tokens or raise the context")


@dataclass
class FleetStats:
    evictions: int = 0
    replacements: int = 0
    last_replace_s: float = 0.0          # from an eviction to its replacement taking requests
    last_eviction_at: float = 0.0        # wall clock (time.time()) of the last eviction
    last_join_at: float = 0.0            # wall clock of the last replacement taking requests


class RolloutBackend:
    def __init__(self, cfg: BackendConfig, rollout_fn: RolloutFn = single_turn, items: list[dict] | None = None):
        from transformers import AutoTokenizer
        if cfg.server.context_length == 0:           # the model's own context
            cfg = dataclasses.replace(cfg, server=dataclasses.replace(
                cfg.server, context_length=model_context(cfg.model_path) or 2048))
        cfg.server.validate()                # attached servers off loopback need a token; engine=vllm needs vLLM
        cfg.cluster.validate()               # and strings the attach API was given become their enums
        cfg = dataclasses.replace(cfg, server=dataclasses.replace(cfg.server, api_key=cfg.server.token()))
        self.cfg = cfg
        self.tokenizer = AutoTokenizer.from_pretrained(cfg.model_path)
        self.items = items if items is not None else task_items(cfg.task, cfg.seed)
        check_prompts(self.items, self.tokenizer, cfg.rollout, cfg.server.context_length)
        self.rollout_fn = rollout_fn
        self.fleet = None
        self.rollout = None                  # the manager's host: call(method, *args)
        self.sync = None
        self.last_push = None                # the PushStats of the last push_weights
        self.sharded = None                  # sharded.RankState of this rank (0) for FSDP2 pushes, from the first
        self.version = 0
        self.servers: list[str] = []         # members: they get weight pushes and rollout requests
        self.stats = FleetStats()
        self._state: dict | None = None
        self._ready: list[tuple[str, float]] = []     # started replacements: (url, when its predecessor left)
        self._catching_up: dict[str, float] = {}      # in the pushes, not yet in the router
        self._lock = threading.Lock()
        self._workers: list[threading.Thread] = []

    # ---- the four calls a trainer makes --------------------------------------------------------
    def start(self, model: torch.nn.Module | None = None, version: int = 0, manager: bool = True) -> None:
        """Start (or connect to) servers, weight sync and the manager. With `model`, its weights are
        pushed as `version` before the first rollout; without, the servers serve `model_path`.
        `manager=False` starts no rollout manager: for a trainer that brings its own prompts and
        rewards and samples with `generate` (TRL's rollout_func)."""
        from weight_sync.sender import WeightSync
        self.rollout = self._host() if manager else NoManager()   # a rollout process starts while the servers do
        self.fleet = self._make_fleet()
        if not self.cfg.server.urls and not self.cfg.server.api_key and not self.fleet.loopback():
            # servers off loopback: one secret for this run, unless one was given
            self.cfg = dataclasses.replace(self.cfg, server=dataclasses.replace(
                self.cfg.server, api_key=secrets.token_urlsafe(32)))
            self.fleet.server = self.cfg.server
        first = version - 1 if model is not None else version
        n = self.cfg.server.num_servers
        # A server that dies while the fleet starts is left out, and replaced once the job runs.
        self.servers = list(self.cfg.server.urls) or self.fleet.launch(n, first, pushed=model is not None,
                                                                        at_least=1)
        short = 0 if self.cfg.server.urls else n - len(self.servers)
        ws = self.cfg.weight_sync
        self.sync = WeightSync(self.servers, bucket_bytes=ws.bucket_mb << 20, num_slots=ws.num_slots,
                               timeout_s=ws.timeout_s, min_fraction=ws.min_fraction,
                               api_key=self.cfg.server.api_key or None, topology=ws.topology, fan_out=ws.fan_out,
                               host=self.fleet.host, protocol=ws.protocol, device_name=ws.device_name,
                               delta=ws.delta, audit_log=self._push_log())
        if model is not None:
            self._push(model, version)
        self.version = version
        if short and self.cfg.cluster.replace_evicted:
            log.warning("%d of %d servers did not start: replacements start", short, n)
            for _ in range(short):
                self._start_replacement(time.monotonic())
        self.rollout.start(RolloutSpec(
            self.cfg.rollout, list(self.servers), self.cfg.model_path, self.items, self.cfg.task.reward,
            self.rollout_fn, self.cfg.server.api_key or None, self.cfg.seed, self._state, version,
            engine=self.cfg.server.engine))
        self.rollout.start_manager()

    def next_batch(self, timeout_s: float | None = None, as_of: int | None = None) -> TrainBatch:
        """The next batch_size groups as padded tensors, with GRPO advantages and rollout metrics.
        `as_of`: the version the batch will train, when its push is still in flight (push_in_background;
        the staleness bound is judged against it)."""
        if as_of is None:            # a push in flight admits and evicts servers itself
            self._admit()
        groups, metrics = self.rollout.next_batch(as_of, timeout_s=timeout_s)
        batch = Batch.from_groups(groups, self.tokenizer.pad_token_id)
        rewards = batch.rewards
        if self.cfg.overlong_buffer:
            lengths = torch.tensor([len(s.response_ids) for s in batch.samples])
            penalty = grpo.overlong_penalty(lengths, self.cfg.rollout.max_new_tokens, self.cfg.overlong_buffer,
                                            self.cfg.overlong_penalty)
            rewards = rewards + penalty
            metrics.overlong_penalty_mean = float(penalty.mean())
        advantages = grpo.group_advantages(rewards, self.cfg.rollout.group_size, self.cfg.normalize_std)
        # tokens/s of the members only: an evicted server is gone from the rows
        metrics.tokens_per_s_by_server = {u: v for u, v in metrics.tokens_per_s_by_server.items() if u in self.servers}
        metrics.fleet = self.fleet_metrics()
        return TrainBatch(**{f.name: getattr(batch, f.name) for f in dataclasses.fields(batch)},
                          advantages=advantages, metrics=metrics)

    def batch_ready(self, as_of: int | None = None) -> bool:
        """Whether next_batch(as_of=as_of) would return at once. A caller on another thread than the
        pushes polls this before next_batch: a next_batch that waits holds the manager's channel, and
        a push that the wait needs would queue behind it."""
        return self.rollout.batch_ready(as_of)

    def generate(self, prompts: list[list[int]], sampling_params: dict | None = None) -> list[Generation]:
        """One completion per prompt (token ids), sampled on the member servers spread round-robin:
        the completion's ids, each token's logprob and the weight version that sampled it. A request a
        server fails is sent again to the next server; the call fails only when every server has.
        For trainers that group and score samples themselves; the manager's groups are next_batch."""
        if not self.servers:
            raise RuntimeError("generate() before start(): no servers")
        params = {**self.cfg.rollout.sampling_params(), **(sampling_params or {})}
        return run_coroutine(generate_on(list(self.servers), prompts, params, self.cfg.server.api_key or None,
                                         self.version, self.cfg.server.engine))

    def push_weights(self, model, version: int, on_policy: bool = False):
        """Stream `model`'s weights into every server as `version` (two-phase: every server that
        stays in the push flips, or none), evict the servers it lost, then let the manager apply
        its in-flight policy (`on_policy`: the next batch is generated on `version` alone, as in
        sync mode). Returns the push's PushStats. A model sharded with FSDP2
        (`fully_shard`) is pushed from rank 0, which holds the backend, while every other rank calls
        `weight_sync.sharded.push_sharded(model, version, state=state)` (its own RankState, the
        same at every push): each rank writes the shard it holds, and no rank gathers the model."""
        self._admit()
        self._evict_down()
        stats = self.last_push = self._push(model, version)
        self.version = version
        for url in list(stats.dropped) + [u for u in stats.pending if self._dead(u)]:
            if url in self.servers:
                self._evict(url, replace=self.cfg.cluster.replace_evicted)
        self.rollout.on_weights_updated(version, on_policy)
        self._admit()
        return stats

    def push_in_background(self, model, version: int) -> "PushInFlight":
        """push_weights(model, version) on a thread of its own, so the trainer can take the next batch
        (next_batch(as_of=version), when one is ready) and run its forward and backward passes while
        the weights stream. The model's weights must not change until the push is done: the caller
        waits on it (PushInFlight.wait) before its next optimizer step."""
        return PushInFlight(lambda: self.push_weights(model, version), version)

    def close(self) -> None:
        try:
            if self.rollout is not None:
                self.rollout.close()
                self.rollout = None
        finally:
            for t in self._workers:
                t.join(timeout=self.cfg.server.start_timeout_s)
            # The servers stop (a wait on their exits) while the sender closes (its transfer engine's
            # teardown holds this process for up to 1 s).
            stopped = in_background(self.fleet.close, "fleet-close") if self.fleet is not None else lambda: None
            try:
                if self.sync is not None:
                    self.sync.close()
                    self.sync = None
            finally:
                self.servers = []
                stopped()

    # ---- the fleet by hand -------------------------------------------------------------------------
    def add_servers(self, k: int) -> list[str]:
        """Start k servers; they cold-start from a live one and join the pushes and the router
        (the router once they serve the current version). Returns their URLs."""
        urls = self.fleet.launch(k, self.version, peer=self.servers[0] if self.servers else None)
        with self._lock:
            self._ready += [(u, time.monotonic()) for u in urls]
        self._admit()
        return urls

    def remove_servers(self, urls: list[str]) -> None:
        """Take servers out: they leave the router (their requests resume elsewhere) and the
        pushes, then stop."""
        for url in urls:
            self._evict(url, replace=False)

    def fleet_metrics(self) -> dict:
        return {"fleet/servers": len(self.servers), "fleet/evictions": self.stats.evictions,
                "fleet/replacements": self.stats.replacements, "fleet/last_replace_s": self.stats.last_replace_s,
                "fleet/last_eviction_at": self.stats.last_eviction_at, "fleet/last_join_at": self.stats.last_join_at,
                **self._kv_tier_metrics()}

    def _kv_tier_metrics(self) -> dict:
        """The servers' KV tier counters, summed (kv_tier/loaded_blocks, kv_tier/store_loaded_tokens, ...),
        where the job gave them tiers; a server that does not answer in 2 s is left out."""
        s = self.cfg.server
        if s.engine != "riptide" or not (s.kv_host_gb or s.kv_store == "mooncake"):
            return {}
        import requests
        headers = {"Authorization": f"Bearer {s.api_key}"} if s.api_key else {}
        out: dict = {}
        for url in list(self.servers):
            try:
                tier = requests.get(f"{url}/get_server_info", headers=headers, timeout=2).json().get("kv_tier", {})
            except (requests.RequestException, ValueError):
                continue
            for k, v in tier.items():
                out[f"kv_tier/{k}"] = out.get(f"kv_tier/{k}", 0) + v
        return out

    # ---- checkpoints -----------------------------------------------------------------------------
    def state_dict(self) -> dict:
        """Pause the manager (in-flight samples become partial), read its state, resume."""
        return self.rollout.state()

    def load_state_dict(self, state: dict) -> None:
        """Before start(): the data position and the unconsumed (partial) groups to resume."""
        self._state = state

    # ---- membership ----------------------------------------------------------------------------------
    def _push(self, model, version: int):
        from weight_sync import sharded
        from weight_sync.sender import CommitIncomplete
        try:
            inflight = at_commit(self.cfg.rollout.update_policy)
            if lora.is_adapted(model) and self.cfg.weight_sync.adapter_only:     # a peft model: its adapter alone
                adapter, scales = lora.adapter_tensors(model)
                return self.sync.push_adapter(adapter, scales, lora.base_weights(model), version, inflight=inflight)
            if lora.is_adapted(model):       # the weights it computes with, by the base's names
                model = lora.merged_weights(model)
            if sharded.is_sharded(model):    # FSDP2: rank 0 here; every other rank calls push_sharded(model, version)
                self.sharded = self.sharded or sharded.RankState()
                return sharded.push_sharded(model, version, self.sync, inflight=inflight,
                                            state=self.sharded)
            return self.sync.push(model, version, inflight=inflight)
        except CommitIncomplete as e:
            # every server had prepared: the version stands; the ones that did not confirm learn it
            log.warning("%s", e)
            return e.stats

    def _evict(self, url: str, replace: bool) -> None:
        log.warning("evicting %s from the fleet%s", url, " (a replacement starts)" if replace else "")
        self.servers = [u for u in self.servers if u != url]
        self._catching_up.pop(url, None)
        self.sync.remove_receiver(url)
        self.rollout.remove_server(url)
        self.fleet.stop(url)
        self.stats.evictions += 1
        self.stats.last_eviction_at = time.time()
        if replace and self.servers:
            self._start_replacement(time.monotonic())

    def _start_replacement(self, since: float) -> None:
        worker = threading.Thread(target=self._replace, args=(since,), name="fleet-replace", daemon=True)
        self._workers.append(worker)
        worker.start()

    def _evict_down(self) -> None:
        """Servers the router has marked down (no answer, or no progress, for progress_timeout_s:
        a lost host, a cut link, a frozen process) leave before the push rather than cost it a hop
        timeout; one server always stays."""
        down = [u for u in self.rollout.down_servers() if u in self.servers]
        for url in down[:len(self.servers) - 1]:
            self._evict(url, replace=self.cfg.cluster.replace_evicted)

    def _replace(self, since: float) -> None:
        try:
            urls = self.fleet.launch(1, self.version, peer=self.servers[0])
        except Exception as e:  # no room now (a node is gone): the fleet goes on smaller
            log.warning("no replacement started: %s", e)
            return
        with self._lock:
            self._ready += [(u, since) for u in urls]

    def _admit(self) -> None:
        """Between two calls of the trainer (never during a push): started servers join the pushes;
        a server joins the router once it serves the version the trainer pushed last."""
        with self._lock:
            ready, self._ready = self._ready, []
        for url, since in ready:
            self.sync.add_receiver(url)
            self._catching_up[url] = since
        for url, since in list(self._catching_up.items()):
            if self._version_of(url) == self.version:
                del self._catching_up[url]
                self.rollout.add_server(url)
                self.servers.append(url)
                self.stats.replacements += 1
                self.stats.last_replace_s = time.monotonic() - since
                self.stats.last_join_at = time.time()
                log.info("%s joined the fleet at version %d", url, self.version)

    def _version_of(self, url: str) -> int | None:
        return served_version(url, self.cfg.server.api_key or None)

    def _dead(self, url: str) -> bool:
        return self._version_of(url) is None

    def _push_log(self):
        """weight_sync.audit: the record of every push started (weight_sync/audit.py)."""
        if not (self.cfg.weight_sync.audit and self.cfg.log_dir):
            return None
        from weight_sync.audit import AuditLog
        return AuditLog(f"{self.cfg.log_dir}/pushes.jsonl")

    def _make_fleet(self):
        c = self.cfg
        return make_fleet(c.model_path, c.server, c.weight_sync, c.cluster, c.seed, c.log_dir)

    def _host(self):
        """Where the rollout manager runs (fleets.rollout_host): in a thread of this process when the
        rollout function lives in __main__, which no other process can import."""
        in_main = getattr(self.rollout_fn, "__module__", None) == "__main__"
        if in_main and self.cfg.cluster.rollout_process:
            log.warning("the rollout function %s is defined in __main__, which another process cannot import: "
                        "the rollout manager runs in a thread of this process instead (move it to a module)",
                        self.rollout_fn.__name__)
        return rollout_host(self.cfg.cluster, in_thread=in_main)

    def __enter__(self) -> "RolloutBackend":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


class PushInFlight:
    """A push on its own thread: wait() returns its PushStats, or raises what it raised, and tells
    how long the caller waited (`waited_s`)."""

    def __init__(self, push: Callable[[], object], version: int):
        self.version, self.waited_s = version, 0.0
        self._result: object = None
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, args=(push,), name=f"push-v{version}", daemon=True)
        self._thread.start()

    def _run(self, push: Callable[[], object]) -> None:
        try:
            self._result = push()
        except BaseException as e:       # noqa: BLE001  handed to the caller by wait()
            self._error = e

    def done(self) -> bool:
        return not self._thread.is_alive()

    def wait(self):
        t0 = time.perf_counter()
        self._thread.join()
        self.waited_s += time.perf_counter() - t0
        if self._error is not None:
            raise self._error
        return self._result


def served_version(url: str, api_key: str | None = None) -> int | None:
    """The weight version `url` serves; None when it does not answer."""
    try:
        r = httpx.get(f"{url}/get_weight_version", timeout=5,
                      headers={"Authorization": f"Bearer {api_key}"} if api_key else {})
        return int(r.json()["weight_version"]) if r.status_code == 200 else None
    except (httpx.HTTPError, ValueError, KeyError):
        return None


class NoManager(RolloutHost):
    """The manager's place in a backend started with manager=False: no rollout loop, nothing to
    tell it of servers and versions."""

    def start(self, spec) -> None:
        pass

    def call(self, method: str, *args, timeout_s: float | None = None):
        return None

    def close(self) -> None:
        pass


async def generate_on(urls: list[str], prompts: list[list[int]], params: dict, api_key: str | None,
                      version: int, engine: str = "riptide") -> list[Generation]:
    clients = [client_for(engine, u, api_key=api_key) for u in urls]
    tag = secrets.token_hex(4)

    async def one(i: int, ids: list[int]) -> Generation:
        for attempt in range(len(clients)):
            client = clients[(i + attempt) % len(clients)]
            try:
                return await client.generate(ids, params, f"gen-{tag}-{i}-{attempt}", fallback_version=version)
            except RequestRefused:
                raise                          # the request itself is wrong: every server would refuse it
            except ServerError as e:
                if attempt == len(clients) - 1:
                    raise
                log.warning("prompt %d: %s; sending it to the next server", i, e)
    try:
        return list(await asyncio.gather(*(one(i, ids) for i, ids in enumerate(prompts))))
    finally:
        await asyncio.gather(*(c.close() for c in clients))


def run_coroutine(coro):
    """asyncio.run, also from a thread that already runs a loop (a notebook): then on a thread of its own."""
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return asyncio.run(coro)
    out: list = []
    in_background(lambda: out.append(asyncio.run(coro)), "generate")()
    return out[0]


def in_background(fn: Callable[[], None], name: str) -> Callable[[], None]:
    """Start fn() on a thread of its own; returns a join() that waits for it and raises what it raised."""
    errors: list[BaseException] = []

    def target() -> None:
        try:
            fn()
        except BaseException as e:
            errors.append(e)
    thread = threading.Thread(target=target, name=name)
    thread.start()

    def join() -> None:
        thread.join()
        if errors:
            raise errors[0]
    return join
