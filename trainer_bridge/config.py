"""The typed schema of a Riptide job. Hydra composes YAML onto it; code below the entry point sees
only these dataclasses. Every field has its help text; `validate()` says what to change."""
from __future__ import annotations

from dataclasses import dataclass, field

from rollout.config import RolloutConfig
from weight_sync.fanout import tree_parents


def f(default, help: str, **kw):
    if isinstance(default, (list, dict)):
        return field(default_factory=lambda: type(default)(default), metadata={"help": help}, **kw)
    return field(default=default, metadata={"help": help}, **kw)


@dataclass
class ModelConfig:
    path: str = f(".cache/tiny-chars", "a local Hugging Face checkpoint directory (never downloaded)")
    build_tiny: bool = f(True, "build a tiny random model at `path` when it holds none")
    hidden: int = f(128, "tiny model: hidden size")
    layers: int = f(2, "tiny model: decoder layers")
    heads: int = f(4, "tiny model: attention heads")
    kv_heads: int = f(2, "tiny model: key/value heads")
    tokenizer: str = f("chars", "tiny model: 'chars' (one token per character) or 'bpe'")
    seed: int = f(0, "tiny model: initialisation seed")


@dataclass
class TaskConfig:
    name: str = f("copy", "copy | reverse | sort | add (built in, generated) or dataset (task.path)")
    num_digits: int = f(3, "digits per built-in problem")
    num_prompts: int = f(4096, "built-in problems generated")
    path: str = f("", "dataset: a JSONL or Parquet file of prompt/answer rows")
    prompt_key: str = f("prompt", "dataset: the prompt column")
    answer_key: str = f("answer", "dataset: the answer column")
    reward: str = f("trainer_bridge.tasks:partial_credit",
                    "module:function (async (sample) -> float) or exact_match | math_answer | format_check")


@dataclass
class ServerConfig:
    num_servers: int = f(1, "embedded servers to start as subprocesses")
    urls: list = f([], "connect to these running servers instead of starting any")
    max_running_requests: int = f(64, "sequences each server decodes together")
    context_length: int = f(512, "tokens per sequence (prompt + response)")
    device: str = f("auto", "auto | cpu | cuda[:N] | npu[:N]")
    dtype: str = f("auto", "auto | float32 | bfloat16 | float16")
    api_key: str = f("", "bearer token for servers that require one")
    start_timeout_s: float = f(180.0, "how long a server may take to come up")


@dataclass
class WeightSyncConfig:
    protocol: str = f("tcp", "Mooncake protocol: tcp here; rdma on clusters")
    device_name: str = f("", "Mooncake device name(s), e.g. RDMA NICs; the trainer and the servers use the same")
    bucket_mb: int = f(64, "bucket size in MiB")
    num_slots: int = f(2, "staging slots per receiver (pipeline depth)")
    timeout_s: float = f(60.0, "per-hop timeout; a receiver slower than this is named and dropped")
    inflight: str = f("continue", "running requests at a new version: continue on the new weights, or abort")
    topology: str = f("tree", "star (the trainer writes to every server) | chain | tree (servers relay: "
                              "the trainer writes each byte once)")
    fan_out: int = f(2, "tree: servers each one relays to")
    min_fraction: float = f(0.5, "a push commits on the servers that remain while at least this share of the "
                                 "fleet does; lost ones are evicted (1.0: all or none)")

    def validate(self) -> None:
        if self.inflight not in ("continue", "abort"):
            raise ValueError(f"weight_sync.inflight={self.inflight!r}: use 'continue' or 'abort'")
        if self.bucket_mb < 1:
            raise ValueError(f"weight_sync.bucket_mb={self.bucket_mb}: must be >= 1")
        tree_parents(1, self.topology, self.fan_out)     # names a bad topology or fan_out
        if not 0.0 <= self.min_fraction <= 1.0:
            raise ValueError(f"weight_sync.min_fraction={self.min_fraction}: must be in [0, 1]")
        if self.timeout_s <= 0:
            raise ValueError(f"weight_sync.timeout_s={self.timeout_s}: must be > 0")


@dataclass
class ClusterConfig:
    kind: str = f("local", "local (servers and the rollout manager as subprocesses) | ray (Ray actors)")
    address: str = f("", "ray: the cluster to join (ray://host:10001 or host:6379; '' starts one on this machine)")
    server_cpus: float = f(1.0, "ray: CPUs in each server's placement group")
    tensor_parallel: int = f(1, "ray: accelerators (GPU / NPU) in each server's placement group")
    placement_timeout_s: float = f(60.0, "ray: how long a server's placement may wait for resources")
    rollout_process: bool = f(True, "run the rollout manager in its own process (off the trainer's GIL)")
    replace_evicted: bool = f(True, "start a replacement for each server evicted from the fleet")

    def validate(self) -> None:
        if self.kind not in ("local", "ray"):
            raise ValueError(f"cluster.kind={self.kind!r}: use local or ray (cluster=local | cluster=ray)")
        if self.server_cpus <= 0 or self.tensor_parallel < 1 or self.placement_timeout_s <= 0:
            raise ValueError(f"cluster: server_cpus={self.server_cpus}, tensor_parallel={self.tensor_parallel}, "
                             f"placement_timeout_s={self.placement_timeout_s}: need > 0, >= 1, > 0")


@dataclass
class TrainerConfig:
    steps: int = f(200, "training steps (one rollout batch and one optimizer step each)")
    lr: float = f(2e-3, "AdamW learning rate (the peak, with a schedule)")
    lr_schedule: str = f("constant", "constant | cosine | linear: decay from lr to lr * min_lr_ratio by the last step")
    lr_warmup_steps: int = f(0, "steps of linear warm-up from lr / warmup to lr")
    min_lr_ratio: float = f(0.1, "cosine/linear: the last step's lr as a fraction of lr")
    weight_decay: float = f(0.0, "AdamW weight decay")
    betas: list = f([0.9, 0.99], "AdamW betas")
    grad_clip: float = f(1.0, "clip the global gradient norm to this (0: off)")
    micro_batch_size: int = f(64, "sequences per forward/backward; gradients accumulate over the batch")
    clip_low: float = f(0.2, "PPO clip below 1")
    clip_high: float = f(0.28, "PPO clip above 1 (DAPO clip-higher)")
    loss_agg: str = f("token-mean", "token-mean | seq-mean-token-mean")
    normalize_std: bool = f(True, "divide group advantages by the group's reward std")
    tis_cap: float = f(2.0, "truncated importance sampling cap between trainer and server logprobs (0: off)")
    kl_coef: float = f(0.0, "k3 KL penalty to the initial model (0: off, no reference model kept)")
    dtype: str = f("float32", "float32 | bfloat16 (autocast on accelerators)")
    device: str = f("auto", "auto | cpu | cuda[:N] | npu[:N]")
    checkpoint_every: int = f(0, "save a checkpoint every N steps (0: only at the end)")
    resume: str = f("", "a checkpoint directory to continue from, or 'latest' in run_dir")
    seed: int = f(0, "trainer seed")

    def validate(self) -> None:
        checks = [(self.steps >= 1, f"trainer.steps={self.steps}: must be >= 1"),
                  (self.lr > 0, f"trainer.lr={self.lr}: must be > 0"),
                  (self.lr_schedule in ("constant", "cosine", "linear"),
                   f"trainer.lr_schedule={self.lr_schedule!r}: use constant, cosine or linear"),
                  (self.lr_warmup_steps >= 0, f"trainer.lr_warmup_steps={self.lr_warmup_steps}: must be >= 0"),
                  (0.0 <= self.min_lr_ratio <= 1.0, f"trainer.min_lr_ratio={self.min_lr_ratio}: must be in [0, 1]"),
                  (self.micro_batch_size >= 1, f"trainer.micro_batch_size={self.micro_batch_size}: must be >= 1"),
                  (self.loss_agg in ("token-mean", "seq-mean-token-mean"),
                   f"trainer.loss_agg={self.loss_agg!r}: use token-mean or seq-mean-token-mean"),
                  (self.dtype in ("float32", "bfloat16"), f"trainer.dtype={self.dtype!r}: use float32 or bfloat16")]
        for ok, message in checks:
            if not ok:
                raise ValueError(message)


@dataclass
class LoggerConfig:
    wandb: bool = f(True, "log to wandb")
    project: str = f("riptide", "wandb project")
    mode: str = f("auto", "auto (online when logged in, else offline) | online | offline | disabled")
    log_samples: int = f(4, "sample completions per wandb table")
    progress: bool = f(True, "a progress bar on the console")


@dataclass
class JobConfig:
    model: ModelConfig = field(default_factory=ModelConfig)
    task: TaskConfig = field(default_factory=TaskConfig)
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    weight_sync: WeightSyncConfig = field(default_factory=WeightSyncConfig)
    server: ServerConfig = field(default_factory=ServerConfig)
    cluster: ClusterConfig = field(default_factory=ClusterConfig)
    trainer: TrainerConfig = field(default_factory=TrainerConfig)
    logger: LoggerConfig = field(default_factory=LoggerConfig)
    run_dir: str = f("runs/default", "checkpoints, metrics.jsonl, the plot and the wandb run go here")
    mode: str = f("async", "async (the manager generates while the trainer trains) | sync (generate, wait, train)")
    seed: int = f(0, "seed of the data order and the servers")

    def validate(self) -> "JobConfig":
        self.rollout.validate()
        self.weight_sync.validate()
        self.cluster.validate()
        self.trainer.validate()
        if self.mode not in ("async", "sync"):
            raise ValueError(f"mode={self.mode!r}: use async or sync")
        if self.server.num_servers < 1 and not self.server.urls:
            raise ValueError(f"server.num_servers={self.server.num_servers}: must be >= 1 (or give server.urls)")
        if self.rollout.group_size < 2:
            raise ValueError(f"rollout.group_size={self.rollout.group_size}: GRPO needs >= 2 samples per prompt")
        return self

