"""`riptide-serve` / `python -m inference_server`: flags named as SGLang's launcher names them.

The one module that wires the inference server and weight sync together: neither package imports
the other; here the engine is adapted to the receiver's `ServingEngine` and the weight-sync routes
mount on the server's app."""
from __future__ import annotations

import argparse
import functools
import logging
import os
import sys
import time

import torch
import uvicorn

from inference_server import weights
from inference_server.engine import Engine, EngineArgs, PauseMode
from inference_server.http_server import create_app
from inference_server.process import API_KEY_ENV
from platforms import platform_of
from platforms.process import is_loopback, watch_parent
from weight_sync import live_digest, routes
from weight_sync.audit import AuditLog
from weight_sync.clients import receiver_status
from weight_sync.receiver import Receiver
from weight_sync.transports import Transport
from weight_sync.transports.mooncake import leave_engines_to_exit, open_mooncake


def weight_sync_args(p: argparse.ArgumentParser) -> None:
    """How the server takes weights: at start, and by pushes."""
    p.add_argument("--weight-sync-host", default=None, help="address Mooncake listens on (default: --host)")
    p.add_argument("--weight-sync-protocol", default="auto",
                   help="Mooncake protocol: auto (the platform's: tcp on CPU, rdma on GPUs given NICs, ascend_direct "
                        "on NPUs), tcp, rdma, ...")
    p.add_argument("--weight-sync-device", default="", help="Mooncake device name(s), e.g. an RDMA NIC")
    p.add_argument("--weight-sync-mode", default="shadow", choices=["shadow", "in_place"],
                   help="shadow: stage into a second copy, flip by pointer swap; in_place: no second copy, "
                        "pause and write into the live weights")
    p.add_argument("--adapter-merge", action="store_true",
                   help="merge each pushed LoRA adapter into a copy of the base before its commit (default, "
                        "where the engine's path can: served in the forward from the commit, merged beside the steps)")
    p.add_argument("--weights-from-peer", default=None,
                   help="URL of a live server: start without reading weights from disk and pull them from it")
    p.add_argument("--no-weights", action="store_true",
                   help="start without reading weights (a host without the checkpoint's weights: --model-path then "
                        "needs only the config and tokenizer) and serve once a push lands, e.g. the trainer's first")
    p.add_argument("--commit-log", default=None,
                   help="append a JSON line per weight commit (version, update id, digest of the weights that "
                        "serve, when) and one for weights loaded at start, to this file (a directory: "
                        "commits-PORT.jsonl in it): the record an audit reads")


def kv_tier_args(p: argparse.ArgumentParser) -> None:
    """The paged cache's tiers behind the pool, and old weights' blocks kept (kv_tier.py, blocks.py)."""
    p.add_argument("--kv-keep-versions", type=int, default=0,
                   help="paged cache: cached blocks (pool, host tier, store) of this many earlier weight versions stay, "
                        "for requests sent with kv_policy=continue, which take them and report their age (meta_info "
                        "kv_versions, kv_age); other requests never do; 0 (default): none")
    p.add_argument("--kv-host-gb", type=float, default=0.0,
                   help="a second KV tier in host memory (paged cache): prefix-cache blocks evicted from the pool are "
                        "kept there, digest-checked, and loaded back for a request whose tokens begin with them (a "
                        "multi-turn episode's next turn) instead of prefilled; 0 (default): none")
    p.add_argument("--kv-store-master", default="",
                   help="the third KV tier, Mooncake Store shared by a fleet: its master's host:port (with "
                        "--kv-store-metadata); blocks this server caches are published there and any server of the "
                        "model loads them (a turn moved to another server does not prefill its prefix)")
    p.add_argument("--kv-store-metadata", default="", help="the Mooncake Store's metadata server URL")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="riptide-serve", description="Riptide's embedded inference server")
    p.add_argument("--model-path", required=True, help="a local Hugging Face checkpoint directory")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=30000)
    p.add_argument("--dtype", default="auto", help="auto (fp32 on CPU, bf16 elsewhere), float32, bfloat16, float16")
    p.add_argument("--device", default="auto", help="auto, cpu, cuda[:N], npu[:N]")
    p.add_argument("--max-running-requests", type=int, default=64, help="sequences decoded together")
    p.add_argument("--context-length", type=int, default=None, help="default: the model's, capped at 4096")
    p.add_argument("--max-prefill-tokens", type=int, default=4096, help="prompt tokens per prefill step")
    p.add_argument("--kv-cache-gb", type=float, default=None,
                   help="KV cache memory, any device (default: 85%% of an accelerator's free memory after the "
                        "weights; CPU: --max-running-requests full contexts)")
    p.add_argument("--kv-layout", default="auto", choices=["auto", "paged", "contiguous"],
                   help="paged: blocks allocated as sequences grow (memory by tokens held); contiguous: one "
                        "full-context slot a running sequence; auto: paged under a KV budget (--kv-cache-gb, or "
                        "an accelerator's memory) and on a CPU where its C kernel builds (fp32), else contiguous")
    p.add_argument("--kv-block-size", type=int, default=0,
                   help="positions a KV block (paged); 0 (default): 128 on CPU, 16 on an accelerator")
    kv_tier_args(p)
    p.add_argument("--speculative", default="off", choices=["off", "auto", "on"],
                   help="speculative decoding of the tail: drafts from a request's group siblings and its prompt's "
                        "earlier samples, verified by the policy (the sampled distribution unchanged); auto: on the "
                        "steps where the measured cost says it pays (few rows), on: every step with a draft (needs "
                        "the paged KV cache)")
    p.add_argument("--speculative-tokens", type=int, default=5, help="drafted tokens a sequence a step at most")
    p.add_argument("--cpu-threads", type=int, default=None,
                   help="CPU device: torch threads of a model step (default: OMP_NUM_THREADS if set, else cores - 1, at least 1)")
    p.add_argument("--no-cpu-split", dest="cpu_split", action="store_false",
                   help="CPU with one torch thread a step: do not run big steps as two halves on two threads")
    p.add_argument("--no-prefix-share", dest="prefix_share", action="store_false",
                   help="prefill every prompt, even one a running request already holds (for comparison)")
    p.add_argument("--no-prefix-cache", dest="prefix_cache", action="store_false",
                   help="paged: free a finished sequence's blocks instead of keeping them for the same tokens")
    p.add_argument("--api-key", default=os.environ.get(API_KEY_ENV) or None,
                   help=f"bearer token every endpoint but /health then requires (default: ${API_KEY_ENV}, which keeps "
                        f"it off the command line); required off loopback")
    p.add_argument("--seed", type=int, default=0, help="seed of requests that give none")
    p.add_argument("--weight-version", type=int, default=0, help="version of the weights loaded at start")
    weight_sync_args(p)
    p.add_argument("--log-level", default="warning")
    p.add_argument("--parent-pid", type=int, default=None,
                   help="exit when this process is gone (set by launchers, so a killed one leaves no server)")
    a = p.parse_args(argv)
    for flag, v in (("--max-running-requests", a.max_running_requests), ("--cpu-threads", a.cpu_threads)):
        if v is not None and v < 1:
            p.error(f"{flag} must be >= 1")
    if not is_loopback(a.host) and a.api_key is None:
        p.error(f"--host {a.host} is not a loopback address: off loopback every endpoint but /health needs a bearer "
                f"token; set {API_KEY_ENV} (or --api-key)")
    return a


class EnginePort:
    """The engine as weight sync sees it (`weight_sync.receiver.ServingEngine`)."""

    def __init__(self, engine: Engine):
        self.engine = engine

    @property
    def version(self) -> int:
        return self.engine.version

    @property
    def has_weights(self) -> bool:
        return self.engine.has_weights

    def parameters(self) -> dict:
        return {n: p.data for n, p in weights.parameters(self.engine.model).items()}

    def pause(self) -> None:
        self.engine.pause(PauseMode.IN_PLACE).result()

    def resume(self) -> None:
        self.engine.resume().result()

    def abort_all(self) -> int:
        return len(self.engine.abort(None).result())

    def swap(self, tensors: dict, version: int) -> float:
        stall = self.engine.swap_weights(tensors, version).result()
        self.engine.free_retired()          # the engine lets go of the old set; the caller may keep it
        return stall

    def set_version(self, version: int) -> None:
        self.engine.set_version(version).result()

    def adaptable(self) -> set[str]:
        return self.engine.adaptable()

    def swap_adapter(self, tensors: dict, scales: dict, version: int) -> float:
        return self.engine.swap_adapter(tensors, scales, version).result()

    def served(self) -> dict:
        return self.engine.served_weights()

    def mark_torn(self, torn: bool) -> None:
        self.engine.weights_torn = torn


def make_engine(a: argparse.Namespace) -> Engine:
    return Engine(EngineArgs(model_path=a.model_path, dtype=a.dtype, device=a.device,
                             max_running_requests=a.max_running_requests, context_length=a.context_length,
                             max_prefill_tokens=a.max_prefill_tokens, seed=a.seed,
                             weight_version=a.weight_version, cpu_threads=a.cpu_threads, cpu_split=a.cpu_split,
                             prefix_share=a.prefix_share, prefix_cache=a.prefix_cache, kv_layout=a.kv_layout, kv_cache_gb=a.kv_cache_gb,
                             kv_block_size=a.kv_block_size, kv_host_gb=a.kv_host_gb, kv_keep_versions=a.kv_keep_versions, kv_store_master=a.kv_store_master,
                             kv_store_metadata=a.kv_store_metadata, speculative=a.speculative,
                             speculative_tokens=a.speculative_tokens,
                             load_weights=a.weights_from_peer is None and not a.no_weights))


def main(argv: list[str] | None = None) -> None:
    a = parse_args(argv)
    if a.parent_pid is not None:
        watch_parent(a.parent_pid)
    logging.basicConfig(level=a.log_level.upper(), format="%(asctime)s %(name)s %(levelname)s %(message)s")
    try:
        platform = platform_of(a.device)
        mooncake = platform.mooncake(a.weight_sync_protocol, a.weight_sync_device)
    except ValueError as e:
        raise SystemExit(f"riptide-serve: {e}") from None
    if platform.device_type == "cpu" and not os.environ.get("OMP_NUM_THREADS"):
        # Only the engine's thread may hold an OpenMP team of more than one thread. A second team (this
        # thread's, made while loading the weights) leaves libgomp managing more threads than there are
        # cores, and it then parks a team's threads at once after each parallel region: every matmul of a
        # step paid a wake-up (a bf16 8-row linear 170 us against 68; the vs_vllm workload at 366 tok/s
        # against 521 with the same steps run where no second team existed). Loading on one thread costs
        # about 0.5 s here.
        torch.set_num_threads(1)
    try:
        engine = make_engine(a)
    except ValueError as e:
        raise SystemExit(f"riptide-serve: {e}") from None
    def make_transport() -> Transport:
        platform.before_transport(engine.device)
        return open_mooncake(a.weight_sync_host or a.host, mooncake.protocol, mooncake.device_name)
    self_url = f"http://{a.host}:{a.port}"
    commit_log = None
    if a.commit_log:     # a directory: a file of this server's own there
        path = os.path.join(a.commit_log, f"commits-{a.port}.jsonl") if os.path.isdir(a.commit_log) else a.commit_log
        commit_log = AuditLog(path)
    port = EnginePort(engine)
    if commit_log is not None and engine.has_weights:
        now = time.time()
        commit_log.write(kind="load", server=self_url, version=port.version, update_id=None, t_start=now, t_end=now,
                         digest=live_digest(port.parameters()))
    receiver = Receiver(port, make_transport, shadow=a.weight_sync_mode == "shadow",
                        peer_status=functools.partial(receiver_status, api_key=a.api_key),
                        alignment=mooncake.alignment, commit_log=commit_log, name=self_url,
                        forward_adapters=not a.adapter_merge)
    app = create_app(engine, a.model_path, a.host, a.api_key)
    routes.mount(app, receiver, a.api_key, weights_from_peer=a.weights_from_peer, self_url=self_url)
    leave_engines_to_exit()
    uvicorn.run(app, host=a.host, port=a.port, log_level=a.log_level, access_log=False, timeout_keep_alive=75)
    # Stopped: the app's shutdown hooks have stopped the engine and closed the receiver. Leave without
    # the interpreter's teardown (the transfer engine's destructor alone took up to 1 s).
    logging.shutdown()
    sys.stderr.flush()
    sys.stdout.flush()
    os._exit(0)


if __name__ == "__main__":
    main()
