"""A job's host memory, planned before anything starts (servers on this machine's CPU, `cluster=local`).

What a job holds: each server's weights (three times: the shadow copy a push stages into, and the
CPU fast path's stacked projections) and KV cache; the
trainer's weights, gradients and AdamW moments, and the activations of one micro-batch (its token
budget); the processes' own runtime. A job whose settings cannot fit in the host's available memory
stops before anything starts, naming the knob and the numbers. A server given no KV budget
(`server.kv_cache_gb=0`) gets its share of what is left: KV_SHARE of it, split over the servers, and
never more than every running sequence at the full context could use. On an accelerator, or on
other hosts (`cluster=ray`, `server.urls`), each server sizes its own cache (inference_server/kv_cache.py).

The estimates are deliberately round (activations of a decoder layer ~ (5 x hidden + 3 x intermediate)
float32 values a token, as a Llama layer keeps them for backward: 29 KB measured on SmolLM2-135M);
bench/real_model.py reports each process's peak RSS to check them against."""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

GiB = 2**30
HOST_FRACTION = 0.9          # of MemAvailable: the page cache and everything else on the host keep the rest
KV_SHARE = 0.3               # of what the plan leaves free, for the servers' KV caches together
PROCESS_BYTES = int(0.6 * GiB)     # a Python process with torch, transformers and the HTTP stack loaded
SERVER_EXTRA = int(0.3 * GiB)      # a server's step workspace: logits of a batch, attention scratch


@dataclass(frozen=True)
class ModelShape:
    params: int
    kv_bytes_per_token: int      # float32
    layers: int
    hidden: int
    intermediate: int
    vocab: int

    @classmethod
    def of(cls, config: dict) -> "ModelShape":
        hidden, layers = config["hidden_size"], config["num_hidden_layers"]
        heads = config["num_attention_heads"]
        head_dim = config.get("head_dim") or hidden // heads
        kv_heads = config.get("num_key_value_heads") or heads
        inter = config.get("intermediate_size") or 4 * hidden
        vocab = config["vocab_size"]
        per_layer = hidden * heads * head_dim * 2 + 2 * hidden * kv_heads * head_dim + 3 * hidden * inter
        embeddings = vocab * hidden * (1 if config.get("tie_word_embeddings", True) else 2)
        import torch
        from types import SimpleNamespace
        from inference_server.kv_cache import kv_bytes_per_token
        return cls(params=embeddings + layers * per_layer,
                   kv_bytes_per_token=kv_bytes_per_token(SimpleNamespace(**config), torch.float32),
                   layers=layers, hidden=hidden, intermediate=inter, vocab=vocab)


@dataclass(frozen=True)
class MemoryPlan:
    available: int               # bytes the job may use
    servers: int
    server_fixed: int            # one server without its KV
    kv_each: int                 # one server's KV budget
    trainer: int
    rollout: int
    kv_bytes_per_token: int      # the model's, float32

    @property
    def total(self) -> int:
        return self.servers * (self.server_fixed + self.kv_each) + self.trainer + self.rollout

    def describe(self) -> str:
        return (f"{self.servers} server(s) x ({self.server_fixed / GiB:.1f} GiB weights and runtime + "
                f"{self.kv_each / GiB:.1f} GiB KV) + trainer {self.trainer / GiB:.1f} GiB + rollout "
                f"{self.rollout / GiB:.1f} GiB = {self.total / GiB:.1f} GiB of the host's {self.available / GiB:.1f} "
                f"GiB available")


def host_available() -> int:
    info = dict(line.split(":", 1) for line in open("/proc/meminfo"))
    return int(int(info["MemAvailable"].split()[0]) * 1024 * HOST_FRACTION)


def cpu_servers(device: str) -> bool:
    """Whether servers on `device` (server.device) run on this host's CPU (torch imported for auto only)."""
    if device.split(":")[0] in ("cuda", "npu"):
        return False
    if device == "cpu":
        return True
    from platforms import choose_device
    return choose_device(device).type == "cpu"


def local_cpu_servers(job) -> bool:
    """Whether the job starts its own embedded servers as processes on this host's CPU."""
    s = job.server
    return not s.urls and job.cluster.kind == "local" and s.engine == "riptide" and cpu_servers(s.device)


def model_shape(path: str) -> ModelShape | None:
    try:
        return ModelShape.of(json.loads((Path(path) / "config.json").read_text()))
    except (OSError, ValueError, KeyError, TypeError):
        return None        # a tiny model built on first use, or a folder config validation names


def trainer_bytes(shape: ModelShape, job) -> int:
    """Weights, gradients and two AdamW moments in float32 (a reference model too with kl_coef), and
    one micro-batch's activations and logits chunk."""
    t = job.trainer
    weights = shape.params * 4 * (4 + (t.kl_coef > 0))
    tokens = getattr(t, "max_tokens_per_micro_batch", 0) or \
        t.micro_batch_size * min(job.server.context_length, job.rollout.max_new_tokens + 256)
    per_token_layer = 4 * (5 * shape.hidden + 3 * shape.intermediate)
    layers = 1 if getattr(t, "gradient_checkpointing", False) else shape.layers
    activations = tokens * (per_token_layer * layers + 4 * shape.hidden * shape.layers)
    chunk = getattr(t, "logits_chunk_tokens", 0) or tokens
    logits = 3 * min(chunk, tokens) * shape.vocab * 4
    return PROCESS_BYTES + weights + activations + logits


def plan_of(job, available: int | None = None) -> MemoryPlan | None:
    """The job's memory on this host, or None where the servers are not this host's CPU processes."""
    s = job.server
    if not local_cpu_servers(job):
        return None
    shape = model_shape(job.model.path)
    if shape is None:
        return None
    available = host_available() if available is None else available
    # weights, the shadow copy a push stages into, and the CPU fast path's stacked projections
    # (model_runner.FusedWeights: q/k/v and gate/up in fp32, every layer packed in bf16), counted in fp32
    server_fixed = PROCESS_BYTES + SERVER_EXTRA + 3 * shape.params * 4
    server_fixed += int(s.kv_host_gb * GiB)       # the host KV tier (server.kv_host_gb): its own budget, host memory
    trainer = trainer_bytes(shape, job)
    rollout = PROCESS_BYTES if job.cluster.rollout_process else 0
    if s.kv_cache_gb:
        kv = int(s.kv_cache_gb * GiB)
    else:
        left = available - s.num_servers * server_fixed - trainer - rollout
        full = s.max_running_requests * s.context_length * shape.kv_bytes_per_token
        kv = max(0, min(full, int(left * KV_SHARE / max(1, s.num_servers))))
    return MemoryPlan(available, s.num_servers, server_fixed, kv, trainer, rollout, shape.kv_bytes_per_token)


def plan_problems(job, p: MemoryPlan) -> list[str]:
    """What does not fit, naming the knob; [] when the plan does."""
    one = job.server.context_length * p.kv_bytes_per_token
    out = []
    if p.kv_each < one:
        knob = f"server.kv_cache_gb={job.server.kv_cache_gb:g}" if job.server.kv_cache_gb else \
            f"the KV budget each server gets ({p.kv_each / GiB:.2f} GiB: {KV_SHARE:.0%} of what the job leaves free)"
        out.append(f"server.context_length={job.server.context_length}: one sequence's KV takes {one / GiB:.2f} GiB, "
                   f"more than {knob}; lower server.context_length (or raise server.kv_cache_gb)")
    if p.total > p.available:
        biggest = max([("server.kv_cache_gb", p.servers * p.kv_each), ("server.num_servers", p.servers * p.server_fixed),
                       ("trainer.max_tokens_per_micro_batch (or trainer.gradient_checkpointing=true)", p.trainer)],
                      key=lambda kv: kv[1])
        out.append(f"the job does not fit in memory: {p.describe()}; lower {biggest[0]}")
    return out
