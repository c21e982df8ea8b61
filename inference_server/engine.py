"""The engine: one thread that steps the model while other threads talk to it through commands.

Bounded: at most `max_running_requests` sequences hold KV slots; the rest wait. Everything that
changes engine state from outside (new requests, aborts, pause, weight swaps) is a command run on
the engine thread between two steps, so a step never sees half an update. An aborted sequence
finishes at once with what it generated so far; a weight swap leaves running sequences running,
and their later tokens carry the new version.
"""
from __future__ import annotations

import enum
import logging
import os
import queue
import threading
import time
from concurrent.futures import Future, InvalidStateError
from dataclasses import dataclass
from typing import Any, Callable

import torch

from inference_server import weights
from inference_server.cpu_split import SplitStepRunner
from inference_server.kv_cache import kv_blocks_that_fit, kv_budget, kv_bytes_per_token, kv_slots_that_fit
from inference_server.paged_kernel import decode_kernel
from inference_server.model_runner import (Adapter, DecoderRunner, GenericRunner, PagedDecoderRunner, Runner,
                                           supports_fast_path)
from inference_server.sampler import Sampler
from inference_server.scheduler import Scheduler
from inference_server.sequence import Finish, Sequence
from inference_server.speculative import DraftIndex, SpecPolicy, check_mode
from platforms import choose_device, choose_dtype, platform_of, usable_cores
from weight_sync import merge_lora

log = logging.getLogger(__name__)


def make_runner(model, num_slots: int, context_length: int, split_threads: int | None = None,
                blocks: tuple[int, int] | None = None) -> Runner:
    """The fast path where the model's family has one, else the generic one; `blocks` (number, size):
    the fast path over a paged KV cache instead of contiguous slots; `split_threads` (CPU, one thread
    a step) runs big fast-path steps as two parts, or as one on a team over every core where that
    measured faster (cpu_split)."""
    if not supports_fast_path(model):
        return GenericRunner(model, num_slots, context_length)
    runner = PagedDecoderRunner(model, *blocks) if blocks else DecoderRunner(model, num_slots, context_length)
    if split_threads is None:
        return runner
    return SplitStepRunner(runner, threads=split_threads, team=usable_cores())


class PauseMode(str, enum.Enum):
    ABORT = "abort"          # abort everything, then hold new requests
    IN_PLACE = "in_place"    # stop stepping; sequences keep their KV cache
    RETRACT = "retract"      # give back KV slots; sequences re-prefill when generation continues


@dataclass
class EngineArgs:
    model_path: str
    dtype: str = "auto"
    device: str = "auto"
    max_running_requests: int = 64
    context_length: int | None = None      # default: the model's, capped at 4096
    max_prefill_tokens: int = 4096
    seed: int = 0
    weight_version: int = 0
    load_weights: bool = True              # False: build from config; weights arrive from a peer (version -1)
    cpu_threads: int | None = None         # CPU device: intra-op threads of a step (None: cores - 1)
    cpu_split: bool = True                 # CPU, 1 thread a step, >= 2 cores: big steps run as two halves
    prefix_share: bool = True              # a prompt already in the KV cache (a GRPO group's n samples) is shared, not prefilled
    prefix_cache: bool = True              # paged: full blocks stay cached under the same weights (blocks.py)
    kv_layout: str = "auto"                # "paged": blocks by tokens held; "contiguous": a full-context slot a
                                           # sequence; "auto": paged under a KV budget (kv_cache_gb, or an
                                           # accelerator's memory) or where the CPU kernel runs, else contiguous
    kv_cache_gb: float | None = None       # KV budget on any device (default: accelerator 85% of free, CPU 25% of available)
    kv_block_size: int = 0                 # positions a block (paged); 0: 128 on CPU, 16 on an accelerator
    kv_host_gb: float = 0.0                # paged: a second tier in host memory for evicted prefix-cache blocks (kv_tier.py)
    kv_store_master: str = ""              # paged: the third tier, Mooncake Store: its master's host:port ...
    kv_store_metadata: str = ""            # ... and its metadata server's URL (kv_tier.StoreMaster starts both)
    kv_store_namespace: str = ""           # the store's keys begin with this (default: riptide-kv/<model folder>)
    kv_keep_versions: int = 0              # paged: cached blocks (pool and tiers) of this many earlier weight versions
                                           # stay, for requests that keep old KV (kv_policy "continue"); 0: none
    speculative: str = "off"               # drafts from a request's siblings and its prompt's history, verified
                                           # by the policy (speculative.py): "off", "on" (every step where a draft
                                           # matches), "auto" (the steps where the measured cost says it pays)
    speculative_tokens: int = 5            # drafted tokens a row at most


@dataclass
class EngineStats:
    prompt_tokens: int = 0                 # prefilled (computed)
    shared_prompt_tokens: int = 0          # copied from a running sequence with the same prompt instead
    generation_tokens: int = 0
    finished_requests: int = 0
    aborted_requests: int = 0
    steps: int = 0
    busy_seconds: float = 0.0
    weight_updates: int = 0
    last_swap_stall_s: float = 0.0
    slot_sorts: int = 0
    peak_running: int = 0                  # most sequences running in one step
    row_forwards: int = 0                  # (sequence, step) pairs: generation_tokens / this = tokens a forward
    spec_steps: int = 0                    # steps that verified drafts
    spec_drafted: int = 0                  # tokens drafted, and accepted by the policy
    spec_accepted: int = 0
    episodes_ended: int = 0                # end_episode calls, and the cached blocks they put first in line
    ended_blocks: int = 0


def load_model(path: str, dtype: torch.dtype, device: torch.device, load_weights: bool = True):
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer
    if load_weights:
        model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype)
    else:               # the architecture only: a peer pushes the weights (cold start)
        model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(path), dtype=dtype)
    model = model.to(device).eval().requires_grad_(False)
    # Own the weights in memory: a file-mapped parameter faults pages in on its first write or
    # read (seconds per GB), which would land inside a weight update or the first decode.
    for p in model.parameters():
        p.data = p.data.clone()
    return model, AutoTokenizer.from_pretrained(path)


def eos_ids(model, tokenizer) -> set[int]:
    ids = set()
    for src in (getattr(model, "generation_config", None), model.config):
        e = getattr(src, "eos_token_id", None) if src is not None else None
        ids.update(e if isinstance(e, (list, tuple)) else [e] if e is not None else [])
    if tokenizer.eos_token_id is not None:
        ids.add(tokenizer.eos_token_id)
    return ids


def cpu_threads(requested: int | None) -> int | None:
    """Intra-op threads for CPU steps. By default one core fewer than the process may use: the HTTP
    thread, the weight-sync receiver and a co-located rollout client need a core, and an OpenMP team
    that has to share its cores with them stalls at every barrier (measured on 2 cores with one busy
    neighbour process: a 64-row decode step took 84 ms with 2 threads, 23 ms with 1; alone, 24 and 27 ms).
    None (leave torch's setting) when OMP_NUM_THREADS is set."""
    if requested is not None:
        if requested < 1:
            raise ValueError(f"cpu_threads must be >= 1, got {requested}")
        return requested
    if os.environ.get("OMP_NUM_THREADS"):
        return None                      # the user's explicit setting, which torch already follows
    return max(1, usable_cores() - 1)


class Engine:
    def __init__(self, args: EngineArgs):
        self.args = args
        self.device = choose_device(args.device)
        self.dtype = choose_dtype(args.dtype, self.device)
        self.model, self.tokenizer = load_model(args.model_path, self.dtype, self.device, args.load_weights)
        cfg = self.model.config
        self.vocab_size = cfg.vocab_size
        self.context_length = args.context_length or min(getattr(cfg, "max_position_embeddings", 4096), 4096)
        self.eos_ids = eos_ids(self.model, self.tokenizer)
        self.cpu_threads = cpu_threads(args.cpu_threads) if self.device.type == "cpu" else None
        split = args.cpu_split and self.cpu_threads == 1 and usable_cores() >= 2
        self._make_runner(args, split)
        if split:
            self.scheduler.pair_newcomers = 4
        self.sampler = Sampler(args.seed, self.device)
        self._init_speculative(args)
        self.version = args.weight_version if args.load_weights else -1
        self.has_weights = args.load_weights     # False until a peer pushed them (cold start)
        self.weights_torn = False                # an in-place update left the live weights mixed
        self.retired: list[list[torch.Tensor]] = []
        self._slots_dirty = False
        self.stats = EngineStats()
        self._commands: queue.SimpleQueue[tuple[Callable, Future]] = queue.SimpleQueue()
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def _make_runner(self, args: EngineArgs, split: bool) -> None:
        """The runner over a KV cache of the layout and budget asked, and the scheduler that admits by it."""
        if args.kv_layout not in ("auto", "paged", "contiguous"):
            raise ValueError(f"kv_layout={args.kv_layout!r}: expected 'auto', 'paged' or 'contiguous'")
        cfg, blocks = self.model.config, None
        paged = (args.kv_layout == "paged" or args.kv_layout == "auto" and self._auto_paged(args)) \
            and supports_fast_path(self.model)
        if paged:
            self.max_running = args.max_running_requests
            # on CPU attention reads a block at a time from wherever it lies (paged_attention.c): 128
            # positions (32 KiB a KV head of a 64-wide fp32 head) streamed 1.5x faster than 16 there
            size = args.kv_block_size or (128 if self.device.type == "cpu" else 16)
            if size < 0:
                raise ValueError(f"kv_block_size={args.kv_block_size}: expected positions a block (> 0), or 0 for the default")
            blocks = (kv_blocks_that_fit(args.kv_cache_gb, cfg, self.context_length, size,
                                         self.max_running, self.dtype, self.device), size)
        else:
            self.max_running = kv_slots_that_fit(args.max_running_requests, cfg, self.context_length, self.dtype,
                                                 self.device, args.kv_cache_gb)
        self.runner = make_runner(self.model, self.max_running, self.context_length,
                                  split_threads=1 if split else None, blocks=blocks)
        if isinstance(self._kv_runner, DecoderRunner):
            self._kv_runner.share_prompts = args.prefix_share
        self.scheduler = Scheduler(self.max_running, args.max_prefill_tokens, self.context_length)
        if paged:
            self.scheduler.blocks = self._kv_runner.blocks
        if args.kv_host_gb < 0:
            raise ValueError(f"kv_host_gb={args.kv_host_gb}: expected GiB of host memory (> 0), or 0 for none")
        if bool(args.kv_store_master) != bool(args.kv_store_metadata):
            raise ValueError("kv_store_master and kv_store_metadata go together (a Mooncake Store master's host:port "
                             "and its metadata URL)")
        if args.kv_keep_versions < 0:
            raise ValueError(f"kv_keep_versions={args.kv_keep_versions}: expected earlier weight versions to keep (>= 0)")
        if paged:
            self._kv_runner.blocks.keep_epochs = args.kv_keep_versions
        if args.kv_host_gb or args.kv_store_master:
            if not paged or not args.prefix_cache:
                raise ValueError("kv_host_gb / kv_store_master: the KV tiers hold prefix-cache blocks, so they need "
                                 "the paged KV cache (kv_layout=paged or auto under a budget) and the prefix cache")
            from inference_server.kv_tier import HostTier, StoreTier, TierChain
            blocks, kv = self._kv_runner.blocks, self._kv_runner.kv
            host = HostTier(int(args.kv_host_gb * 2**30), kv, blocks) if args.kv_host_gb else None
            store = None
            if args.kv_store_master:
                name = args.kv_store_namespace or f"riptide-kv/{os.path.basename(os.path.normpath(args.model_path))}"
                store = StoreTier(args.kv_store_master, args.kv_store_metadata, kv, blocks, name)
            blocks.tier = TierChain(host, store)

    def _init_speculative(self, args: EngineArgs) -> None:
        check_mode(args.speculative)
        if args.speculative_tokens < 1:
            raise ValueError(f"speculative_tokens={args.speculative_tokens}: expected drafted tokens a row (>= 1)")
        self.drafts: DraftIndex | None = None
        self.spec_policy: SpecPolicy | None = None
        if args.speculative == "off":
            return
        if not hasattr(self._kv_runner, "verify_step"):
            why = ("the paged KV cache (kv_layout=paged or auto)" if supports_fast_path(self.model)
                   else f"a fast-path model family (llama, mistral, qwen2, qwen3; this is {self.model.config.model_type})")
            if args.speculative == "on":
                raise ValueError(f"speculative=on needs {why}")
            log.warning("speculative=auto: off, it needs %s", why)
            return
        self.drafts = DraftIndex()
        self.spec_policy = SpecPolicy(args.speculative_tokens)

    def _auto_paged(self, args: EngineArgs) -> bool:
        """kv_layout=auto: paged under a KV budget (--kv-cache-gb, an accelerator's memory), and on a CPU
        where the paged decode kernel runs (fp32, a C compiler): it reads blocks in place, 1.08-1.21x
        the contiguous slots' tok/s on short contexts and 1.31x at 16k (bench/vs_vllm.py,
        serve_throughput.py, long_context.py). Without the kernel the blocks are gathered for
        attention, which is slower than the slots, so those stay."""
        if args.kv_cache_gb is not None or platform_of(self.device).accelerator:
            return True
        if decode_kernel(self.device, self.dtype) is not None:
            return True
        # no kernel: the slots, unless every running sequence at the full context would not fit the
        # host's share (a real model's 8k context): memory first
        full = kv_bytes_per_token(self.model.config, self.dtype) * self.context_length * args.max_running_requests
        return full > kv_budget(None, self.device)[0]

    # ---- the loop --------------------------------------------------------------------------
    def start(self) -> None:
        self._thread = threading.Thread(target=self._loop, name="riptide-engine", daemon=True)
        self._thread.start()

    @property
    def running(self) -> bool:
        """Whether the engine's loop is running (started, and not ended)."""
        return self._thread is not None and self._thread.is_alive()

    def shutdown(self) -> None:
        self._stop.set()
        self._wake.set()
        if self._thread is not None:
            self._thread.join(timeout=10)
        tier = getattr(self.scheduler.blocks, "tier", None)
        if tier is not None and tier.store is not None:
            tier.store.close()

    def _loop(self) -> None:
        if self.cpu_threads is not None:
            torch.set_num_threads(self.cpu_threads)     # OpenMP's thread count is per calling thread
        with torch.inference_mode():
            while not self._stop.is_set():
                self._wake.clear()
                self._run_commands()
                if self.scheduler.has_work:
                    self.step()
                else:
                    self._wake.wait(0.05)
        self._run_commands()

    def step(self) -> None:
        t0 = time.perf_counter()
        if self._slots_dirty:
            self._sort_slots()
        blocks = self.scheduler.blocks
        if blocks is not None:
            self._set_kv_epoch(blocks)
        decode, prefill = self.scheduler.schedule()
        for s in prefill:
            self._admitted(s, blocks)
        if prefill and decode and self.args.prefix_share and isinstance(self._kv_runner, DecoderRunner):
            decode, prefill = self._share_prompts(decode, prefill)
        seqs = decode + prefill
        if not seqs:
            return
        self._slots_dirty = self._slots_dirty or bool(prefill)
        total = sum(s.num_tokens - s.cached for s in prefill)         # cached positions are not computed
        if prefill and getattr(self._kv_runner, "share_prompts", False):    # one step's duplicates are computed once
            computed = sum({(s.cached, *s.all_ids): s.num_tokens - s.cached for s in prefill}.values())
            self.stats.shared_prompt_tokens += total - computed
            total = computed
        self.stats.prompt_tokens += total
        self.stats.peak_running = max(self.stats.peak_running, len(seqs))
        drafts = self._propose(decode, prefill) if self.drafts is not None and decode else {}
        if drafts:
            emitted = self._verify(decode, prefill, drafts)
        else:
            tokens, logprobs = self.runner.step(decode, prefill, self.sampler)
            self._cache_prompts(prefill)
            emitted = self._postprocess(seqs, tokens, logprobs)
        if self.drafts is not None:
            for s in seqs:
                self.drafts.update(s, self.version)
                if s.finished:
                    self.drafts.forget(s)
        self.stats.steps += 1
        self.stats.row_forwards += len(seqs)
        self.stats.generation_tokens += emitted
        seconds = time.perf_counter() - t0
        self.stats.busy_seconds += seconds
        if self.spec_policy is not None and not prefill:
            self.spec_policy.record(len(seqs) + sum(len(d) for d in drafts.values()), seconds)

    def _cache_prompts(self, prefill: list[Sequence]) -> None:
        """The newcomers' prompts' full blocks, for whoever comes with the same tokens."""
        blocks = self.scheduler.blocks
        if blocks is not None and blocks.epoch is not None:
            for s in prefill:
                if s.kv_epoch == blocks.epoch:               # not one holding keys and values of older weights
                    blocks.cache(s.all_ids, s.blocks, s.num_tokens)

    def _admitted(self, s: Sequence, blocks) -> None:
        """A newcomer's keys and values: its cached blocks (of older weights too, for a request that keeps
        old KV), the rest computed by this step's weights; `kv_versions` says which weights made which
        positions, and a sequence holding old KV is kept out of this epoch's prefix cache."""
        bs = blocks.block_size if blocks is not None else 0
        epochs = [blocks.epoch_of(b) for b in s.blocks[:s.cached // bs]] if blocks is not None else []
        spans = [(i * bs, (i + 1) * bs, e) for i, e in enumerate(epochs)] + [(len(epochs) * bs, s.num_tokens, self.version)]
        runs: list[list[int]] = []                           # [first position, end, weights version]
        for start, end, v in spans:
            if runs and runs[-1][2] == v:
                runs[-1][1] = end
            elif end > start:
                runs.append([start, end, v])
        s.kv_versions = runs
        s.prefill_version = min(r[2] for r in s.kv_versions) if s.kv_versions else self.version
        mixed = any(e != self.version for e in epochs)
        s.kv_epoch = None if blocks is None or mixed else blocks.epoch

    def _verify(self, decode: list[Sequence], prefill: list[Sequence], drafts: dict[int, list[int]]) -> int:
        """A step whose drafted rows verify their drafts (speculative.py); returns the tokens it gave."""
        verify = [(s, drafts[id(s)]) for s in decode if id(s) in drafts]
        plain = [s for s in decode if id(s) not in drafts]
        states = {id(s): s.generator.get_state() for s, _ in verify if s.generator is not None}
        tokens, logprobs = self.runner.verify_step(plain, verify, prefill, self.sampler)
        self._cache_prompts(prefill)
        r = len(plain)
        emitted, accepted = self._postprocess(plain, tokens[:r], logprobs[:r]), 0
        for s, d in verify:
            kept, ok = self._accept(s, d, tokens[r:r + 1 + len(d)], logprobs[r:r + 1 + len(d)], states.get(id(s)))
            emitted, accepted, r = emitted + kept, accepted + ok, r + 1 + len(d)
        emitted += self._postprocess(prefill, tokens[r:], logprobs[r:])
        drafted = sum(len(d) for _, d in verify)
        self.stats.spec_steps += 1
        self.stats.spec_drafted += drafted
        self.stats.spec_accepted += accepted
        if self.spec_policy is not None:
            self.spec_policy.drafted(len(decode), drafted, accepted)
        return emitted

    def _propose(self, decode: list[Sequence], prefill: list[Sequence]) -> dict[int, list[int]]:
        """Drafts for this step's decode rows (by id), with the KV blocks their positions need; none
        when `auto` finds the step would not pay."""
        if self.spec_policy is not None and self.args.speculative == "auto" and \
                not self.spec_policy.should_draft(len(decode), sum(s.num_tokens - s.cached for s in prefill)):
            return {}
        blocks, out = self.scheduler.blocks, {}
        for s in decode:
            p = s.params
            if p.top_logprobs or not s.output_ids:
                continue
            k = min(self.args.speculative_tokens, p.max_new_tokens - len(s.output_ids) - 1,
                    self.context_length - s.num_tokens - 1)
            d = self.drafts.propose(s, k) if k > 0 else []
            if not d:
                continue
            need = blocks.needed(s.blocks, s.num_tokens + len(d))
            if need > blocks.num_free:
                continue
            if need:
                s.blocks += blocks.alloc(need)
            out[id(s)] = d
        return out

    def _accept(self, seq: Sequence, drafts: list[int], tokens: list[int], logprobs: list[float],
                state) -> tuple[int, int]:
        """The tokens sampled at a verify span's rows, kept up to and including the first that is not
        its draft (all of them when every draft matched), each checked for the end as a decode
        step's. A seeded request's generator ends as if each kept token had been
        drawn by a step of its own. Returns (tokens kept, drafts accepted)."""
        seq.forwards += 1
        kept = 0
        for j, (token, logprob) in enumerate(zip(tokens, logprobs)):
            seq.append(token, logprob, self.version)
            kept += 1
            reason = self._finish_reason(seq, token)
            if reason is not None:
                self._finish(seq, reason)
                break
            if j == len(drafts) or token != drafts[j]:
                break
        accepted = 0
        while accepted < min(kept, len(drafts)) and tokens[accepted] == drafts[accepted]:
            accepted += 1
        seq.spec_drafted += len(drafts)
        seq.spec_accepted += accepted
        if state is not None:
            seq.generator.set_state(state)
            for _ in range(kept):
                torch.rand(1, generator=seq.generator)
        if not seq.finished:
            blocks = self.scheduler.blocks      # the rejected drafts' positions past the sequence's blocks
            keep = blocks.blocks_for(seq.num_tokens)
            if len(seq.blocks) > keep:
                blocks.free(seq.blocks[keep:])
                del seq.blocks[keep:]
            if seq.stream:
                self._notify(seq)
        return kept, accepted

    def _set_kv_epoch(self, blocks) -> None:
        """The prefix cache keeps blocks computed under the weights serving now; new weights (or
        weights left torn) start it afresh, and running sequences' keys and values become mixed."""
        epoch = self.version if self.args.prefix_cache and self.has_weights and not self.weights_torn else None
        if epoch != blocks.epoch:
            blocks.set_epoch(epoch)
            for s in self.scheduler.all():
                s.kv_epoch = None

    @property
    def _kv_runner(self):
        return getattr(self.runner, "runner", self.runner)       # SplitStepRunner wraps a DecoderRunner

    def _share_prompts(self, decode: list[Sequence], prefill: list[Sequence]) -> tuple[list, list]:
        """Newcomers whose prompt a running sequence already holds in the KV cache, computed under
        the current weights (the other samples of a GRPO group, sent a moment earlier): copy its
        KV of the prompt but the last token (paged: its full blocks by reference) and let them join as decode rows, which
        compute that last token as a decode step does. Their slots move up to follow the decode
        rows (running slots stay a dense prefix: decode rows, then the prefills)."""
        donors = {}
        for d in decode:
            if d.prefill_version == self.version and d.slot is not None:
                donors.setdefault(tuple(d.prompt_ids), d)
        shared = [p for p in prefill if not p.output_ids and not p.cached and len(p.prompt_ids) > 1
                  and tuple(p.prompt_ids) in donors]
        if not shared:
            return decode, prefill
        rest = [p for p in prefill if p not in shared]
        b, at = len(decode), {id(s): i for i, s in enumerate(self.scheduler.running)}
        self.scheduler.reorder(list(range(b)) + [at[id(s)] for s in shared + rest])   # newcomers hold no KV yet
        for p in shared:
            self._kv_runner.share(donors[tuple(p.prompt_ids)], p, len(p.prompt_ids) - 1)
            p.prefill_version = self.version
            self.stats.shared_prompt_tokens += len(p.prompt_ids) - 1
            self.stats.prompt_tokens += 1                     # its last prompt token is computed
        return decode + shared, rest

    def _postprocess(self, seqs: list[Sequence], tokens: list[int], logprobs: list[float]) -> int:
        for seq, token, logprob in zip(seqs, tokens, logprobs):
            seq.forwards += 1
            seq.append(token, logprob, self.version)
            reason = self._finish_reason(seq, token)
            if reason is not None:
                self._finish(seq, reason)
            elif seq.stream:
                self._notify(seq)
        return len(seqs)

    def _finish_reason(self, seq: Sequence, token: int) -> dict | None:
        p = seq.params
        if token in p.stop_token_ids or (not p.ignore_eos and token in self.eos_ids):
            return Finish.STOP.reason(matched=token)
        if p.stop:
            tail = self.tokenizer.decode(seq.output_ids[-(max(map(len, p.stop)) + 2):])
            for s in p.stop:
                if s in tail:
                    return Finish.STOP.reason(matched=s)
        if len(seq.output_ids) >= p.max_new_tokens or seq.num_tokens >= self.context_length:
            return Finish.LENGTH.reason(length=len(seq.output_ids))
        return None

    def _finish(self, seq: Sequence, reason: dict) -> None:
        self._release(seq)
        seq.finish(reason)
        self.stats.finished_requests += 1
        self._notify(seq)

    def _release(self, seq: Sequence) -> None:
        self.runner.release(seq)
        move = self.scheduler.remove(seq)
        if move is not None:
            src, dst = move
            self.runner.move(src, dst, self.scheduler.running[dst].num_tokens)
            self._slots_dirty = True

    def _sort_slots(self) -> None:
        """Renumber KV slots when the runner finds an order worth the copy (only checked after a
        sequence joined or left: every running row grows by one token a step)."""
        self._slots_dirty = False
        order = self.runner.better_order([s.num_tokens for s in self.scheduler.running])
        if order is not None:
            self.runner.reorder(order, [s.num_tokens for s in self.scheduler.running])
            self.scheduler.reorder(order)
            self.stats.slot_sorts += 1

    @staticmethod
    def _notify(seq: Sequence) -> None:
        if seq.on_update is not None:
            try:
                seq.on_update(seq)
            except Exception:  # a client that went away must not stop the engine
                log.exception("update callback of request %s failed", seq.rid)

    # ---- commands (thread-safe; each runs on the engine thread between steps) ---------------
    def submit(self, fn: Callable[[], Any]) -> Future:
        fut: Future = Future()
        self._commands.put((fn, fut))
        self._wake.set()
        return fut

    def _run_commands(self) -> None:
        while True:
            try:
                fn, fut = self._commands.get_nowait()
            except queue.Empty:
                return
            try:
                outcome = fut.set_result, fn()
            except BaseException as e:  # the caller gets the error; the engine goes on
                outcome = fut.set_exception, e
            try:
                outcome[0](outcome[1])
            except InvalidStateError:   # the caller gave up (asyncio cancels a wrapped future): the command
                pass                    # ran all the same, and nobody waits for its outcome

    def add(self, seqs: list[Sequence]) -> Future:
        def run():
            for s in seqs:
                if s.params.seed is not None:
                    s.generator = torch.Generator().manual_seed(s.params.seed)
                if s.params.max_new_tokens == 0:
                    s.finish(Finish.LENGTH.reason(length=0))
                    self._notify(s)
                else:
                    self.scheduler.add(s)
        return self.submit(run)

    def abort(self, rid: str | list[str] | None) -> Future:
        """Abort requests (with their n samples) by rid, or, with rid None, all of them."""
        def run():
            rids = [rid] if isinstance(rid, str) else rid
            seqs = self.scheduler.all() if rids is None else [s for r in rids for s in self.scheduler.find(r)]
            for s in seqs:
                self._abort_one(s)
            return seqs
        return self.submit(run)

    def _abort_one(self, seq: Sequence) -> None:
        self._release(seq)
        seq.finish(Finish.ABORT.reason(message="aborted by request"))
        self.stats.aborted_requests += 1
        self._notify(seq)

    def pause(self, mode: PauseMode) -> Future:
        def run():
            if mode is PauseMode.ABORT:
                for s in self.scheduler.all():
                    self._abort_one(s)
            elif mode is PauseMode.RETRACT:
                for s in self.scheduler.running:
                    self.runner.release(s)
                self.scheduler.retract_all()
            self.scheduler.paused = True
        return self.submit(run)

    def resume(self) -> Future:
        def run():
            self.scheduler.paused = False
        return self.submit(run)

    def swap_weights(self, tensors: dict[str, torch.Tensor], version: int) -> Future:
        """Swap in a complete, already-checked set of weights between two steps. Returns stall
        seconds. The replaced tensors wait in `retired` for the caller's `free_retired()`, so that
        freeing them (tens of ms per GB) happens on the caller's thread, not inside the stall."""
        def run():
            t0 = time.perf_counter()
            self.retired.append(weights.swap_in(self.model, tensors))
            self._set_adapter(None)                   # whole weights: what serves is them alone
            self.version, self.has_weights = version, True
            self.stats.weight_updates += 1
            self.stats.last_swap_stall_s = time.perf_counter() - t0
            return self.stats.last_swap_stall_s
        return self.submit(run)

    def free_retired(self) -> list[list[torch.Tensor]]:
        """Hand over (and forget) the weights replaced by swaps: dropping the result frees them."""
        retired, self.retired = self.retired, []
        return retired

    def set_version(self, version: int) -> Future:
        def run():
            self._set_adapter(None)                   # the weights were written whole, in place
            self.version, self.has_weights = version, True
            self.stats.weight_updates += 1
        return self.submit(run)

    # ---- LoRA adapters served in the forward ---------------------------------------------------------
    def _fused(self):
        runner = getattr(self.runner, "runner", self.runner)      # under a SplitStepRunner
        return getattr(runner, "fused", None)

    def adaptable(self) -> set[str]:
        """The modules an adapter may target to be served in the forward (the fused CPU path's
        projections); empty where the runner computes with the modules themselves (merge instead)."""
        fused = self._fused()
        return fused.adaptable if fused is not None else set()

    @property
    def adapter(self) -> Adapter | None:
        fused = self._fused()
        return fused.adapter if fused is not None else None

    def _set_adapter(self, adapter: Adapter | None) -> None:
        fused = self._fused()
        if fused is not None:
            fused.adapter = adapter

    def swap_adapter(self, tensors: dict[str, torch.Tensor], scales: dict[str, float], version: int) -> Future:
        """Serve the base weights with this adapter as `version` from the next step on (stall seconds):
        the adapter's modules must be `adaptable()`."""
        adapter = Adapter(dict(tensors), dict(scales))
        outside = set(adapter.scales) - self.adaptable()
        if outside:
            raise ValueError(f"modules not served in the forward: {sorted(outside)[:3]}")

        def run():
            t0 = time.perf_counter()
            self._set_adapter(adapter)
            self.version, self.has_weights = version, True
            self.stats.weight_updates += 1
            self.stats.last_swap_stall_s = time.perf_counter() - t0
            return self.stats.last_swap_stall_s
        return self.submit(run)

    @torch.no_grad()
    def served_weights(self) -> dict[str, torch.Tensor]:
        """The weights that serve, by checkpoint name: the parameters, with an adapter served in the
        forward merged in (base + B @ A * scale, fp32 as peft merges; new tensors, for a digest or a
        peer's copy)."""
        live = {n: p.data for n, p in weights.parameters(self.model).items()}
        adapter = self.adapter
        if adapter is None:
            return live
        out = dict(live)
        for m, scale in adapter.scales.items():
            out[f"{m}.weight"] = merge_lora(live[f"{m}.weight"], adapter.tensors[f"{m}.lora_A"],
                                            adapter.tensors[f"{m}.lora_B"], scale)
        return out

    def load_from_disk(self, path: str) -> dict[str, torch.Tensor]:
        """Read and check a checkpoint off the engine thread; the engine keeps serving meanwhile."""
        return weights.match(self.model, weights.load_checkpoint(path))

    def kv_gauges(self) -> list[tuple[str, str, int]]:
        """(name, help, value) of the paged KV cache's block counts; none for contiguous slots."""
        blocks = self.scheduler.blocks
        if blocks is None:
            return []
        return [("riptide_kv_blocks_total", "KV cache blocks", blocks.num_blocks),
                ("riptide_kv_blocks_free", "KV cache blocks free", blocks.num_free),
                ("riptide_kv_block_size", "Positions a KV block", blocks.block_size)]

    def end_episode(self, ids: list[int], keep: int = 0) -> Future:
        """A multi-turn episode is over (its tokens; the first `keep` shared with others, its prompt): its
        cached blocks go first when the pool needs room, and not into the host tier (blocks.end).
        Resolves to the pool blocks demoted."""
        def run() -> int:
            blocks = self.scheduler.blocks
            n = blocks.end(ids, keep) if blocks is not None else 0
            self.stats.episodes_ended += 1
            self.stats.ended_blocks += n
            return n
        return self.submit(run)

    def flush_cache(self) -> Future:
        """Forget the prefix cache's blocks nobody holds and the host tier's entries; resolves to the blocks."""
        return self.submit(lambda: self.scheduler.blocks.flush() if self.scheduler.blocks is not None else 0)

    def tier_stats(self) -> dict:
        """The KV tiers' counters (kv_tier.TierChain.stats: the host tier's, the store's as store_*); empty
        without tiers."""
        blocks = self.scheduler.blocks
        tier = getattr(blocks, "tier", None)
        return {**tier.stats, "host_entries": tier.host.size if tier.host else 0} if tier is not None else {}

    def counts(self) -> tuple[int, int]:
        return len(self.scheduler.running), len(self.scheduler.waiting)
