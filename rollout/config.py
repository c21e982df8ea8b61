"""The rollout manager's settings, checked once, with messages that say what to change."""
from __future__ import annotations

import enum
from dataclasses import dataclass, field


# Members are named as their values: Hydra (OmegaConf) takes an enum field by member name, so
# `rollout.update_policy=continue` must be a name (a keyword, hence the functional form).
UpdatePolicy = enum.Enum("UpdatePolicy", [(v, v) for v in ("abort_furthest", "abort_all", "continue")], type=str)
KvPolicy = enum.Enum("KvPolicy", [(v, v) for v in ("fresh", "continue")], type=str)
UpdatePolicy.__doc__ = """What a new weight version does to the requests in flight: abort_furthest aborts
abort_fraction of them, furthest from done, while rollout is a batch ahead; abort_all aborts every
one; continue lets them finish under the new weights (their KV came from the old). An aborted
request resumes at once under the new weights."""


class StalePolicy(str, enum.Enum):
    """What happens to a group that can no longer be consumed within max_staleness.

    drop: thrown away (its tokens are wasted; long samples are the likeliest to go, see length_bias).
    Before issue #16 the default.
    regenerate: its samples restart from the prompt under the newest weights.
    wait: nothing is dropped for its age; the trainer is paced instead. A group whose oldest token
    is `max_staleness` versions old is at risk (the next version would put it past the bound): every
    batch takes the oldest ready groups first, and waits for at-risk groups still running; their
    requests get request slots first (oldest tokens first) and the update policy does not abort
    them. More at-risk groups than a batch holds are still dropped (a deep pipeline, a large
    oversample, can get there: `rollout/drops`). Every trained token is within the bound, and the
    trainer waits whenever a response takes longer than max_staleness train steps. Use it when long
    responses matter and the bound must hold.
    keep (the default): consumed anyway; the loss corrects each token by its behaviour logprob
    (trainer.off_policy), and tokens more than max_token_age versions old are masked
    (loss_mask 0), not the whole sample. max_staleness then only paces admission (capacity), as
    AReaL's max_head_offpolicyness does; with max_token_age -1 (the default) nothing is masked.
    The fastest, and no length bias (bench/long_tail.py); use drop or wait where every trained
    token must be within max_staleness."""
    drop = "drop"
    regenerate = "regenerate"           # its samples restart from the prompt
    wait = "wait"                       # paced: the batch waits for at-risk groups, so none breaks the bound
    keep = "keep"                       # consumed; only tokens older than max_token_age are masked


@dataclass
class RolloutConfig:
    group_size: int = 8                 # samples per prompt (GRPO's n)
    batch_size: int = 8                 # groups per training batch
    max_inflight: int = 64              # requests running on the servers at once
    oversample: float = 1.5             # groups kept going per group a batch needs (>= 1)
    max_staleness: int = 1              # how many versions behind the trainer a group may run (keep: at
                                        # admission; drop / regenerate / wait: every token, at consumption)
    stale_policy: StalePolicy = StalePolicy.keep    # measured: docs/long_tail.md, docs/configuration.md
    max_token_age: int = -1             # stale_policy keep: mask tokens more than this many versions old (-1: none)
    on_policy_warmup: int = 0           # versions before this one generate on-policy (bound 0, as sync mode):
                                        # the first updates, the largest, train on fresh samples
    on_policy_warmup_kl: float = 0.0    # and on from the start while the trainer's last update moved the policy
                                        # more than this KL a token (measured on the batch it trained; 0: off)
    update_policy: UpdatePolicy = UpdatePolicy.abort_furthest
    kv_policy: KvPolicy = KvPolicy.fresh   # continue: requests may take the KV older weights made where the
                                        # servers keep it (server.kv_keep_versions); fresh: the serving weights' only
    abort_fraction: float = 0.5         # abort_furthest: this share of in-flight requests, furthest from
                                        # done, when the next two batches are ready (else none)
    max_new_tokens: int = 256
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    stop: list[str] = field(default_factory=list)
    ignore_eos: bool = False
    group_filter: str = "all_equal"     # all_equal (DAPO dynamic sampling) | none | module:function
    filter_patience: int = 32           # after this many filter drops for one batch, keep what it rejects (0: never)
    rollout_fn: str = "single_turn"     # single_turn | module:function (async (sample, ctx) -> sample), e.g. multi-turn
    use_chat_template: str = "auto"     # auto (when the tokenizer has a chat template) | true | false
    request_timeout_s: float = 600.0
    max_request_retries: int = 3        # moves of one request to another server after failures
    progress_timeout_s: float = 10.0    # a server with requests in flight that shows no progress for this
                                        # long is marked down and its requests move elsewhere
    max_group_retries: int = 2          # a group whose requests failed runs its prompt again this many times
    max_failed_groups: int = 8          # this many failed groups in a row, none succeeding: stop with the error
    seed: int = 0

    def validate(self) -> "RolloutConfig":
        problems = self.problems()
        if problems:
            raise ValueError("\n".join(problems))
        return self

    def problems(self) -> list[str]:
        """Every setting that is wrong, one message each (the enums are coerced on the way)."""
        out = []
        for name, kind in (("update_policy", UpdatePolicy), ("stale_policy", StalePolicy), ("kv_policy", KvPolicy)):
            try:
                setattr(self, name, kind(getattr(self, name)))
            except ValueError:
                out.append(f"rollout.{name}={getattr(self, name)!r}: use one of {[p.value for p in kind]}")
        self.use_chat_template = str(self.use_chat_template).lower()
        checks = [
            (self.use_chat_template in ("auto", "true", "false"),
             f"rollout.use_chat_template={self.use_chat_template!r}: use auto, true or false"),
            (self.group_size >= 1, f"rollout.group_size={self.group_size}: must be >= 1 (GRPO needs >= 2)"),
            (self.batch_size >= 1, f"rollout.batch_size={self.batch_size}: must be >= 1"),
            (self.max_inflight >= 1, f"rollout.max_inflight={self.max_inflight}: must be >= 1"),
            (self.oversample >= 1.0, f"rollout.oversample={self.oversample}: must be >= 1.0 (1.0 = no oversampling)"),
            (self.max_staleness >= 0, f"rollout.max_staleness={self.max_staleness}: must be >= 0"),
            (self.on_policy_warmup >= 0, f"rollout.on_policy_warmup={self.on_policy_warmup}: must be >= 0"),
            (self.on_policy_warmup_kl >= 0,
             f"rollout.on_policy_warmup_kl={self.on_policy_warmup_kl}: must be >= 0 (0: off)"),
            (self.max_token_age >= -1, f"rollout.max_token_age={self.max_token_age}: must be >= 0, or -1 (no limit)"),
            (self.filter_patience >= 0, f"rollout.filter_patience={self.filter_patience}: must be >= 0"),
            (0.0 <= self.abort_fraction <= 1.0, f"rollout.abort_fraction={self.abort_fraction}: must be in [0, 1]"),
            (self.max_new_tokens >= 1, f"rollout.max_new_tokens={self.max_new_tokens}: must be >= 1"),
            (self.temperature >= 0, f"rollout.temperature={self.temperature}: must be >= 0"),
            (0 < self.top_p <= 1, f"rollout.top_p={self.top_p}: must be in (0, 1]"),
            (self.top_k == -1 or self.top_k >= 1, f"rollout.top_k={self.top_k}: must be -1 (off) or >= 1"),
            (all(isinstance(s, str) and s for s in self.stop), f"rollout.stop={self.stop!r}: must be non-empty strings"),
            (bool(self.group_filter), "rollout.group_filter is empty: use all_equal, none or module:function"),
            (self.request_timeout_s > 0, f"rollout.request_timeout_s={self.request_timeout_s}: must be > 0 seconds"),
            (self.max_request_retries >= 0, f"rollout.max_request_retries={self.max_request_retries}: must be >= 0"),
            (self.progress_timeout_s > 0, f"rollout.progress_timeout_s={self.progress_timeout_s}: must be > 0 seconds"),
            (self.max_group_retries >= 0, f"rollout.max_group_retries={self.max_group_retries}: must be >= 0"),
            (self.max_failed_groups >= 1, f"rollout.max_failed_groups={self.max_failed_groups}: must be >= 1"),
        ]
        return out + [message for ok, message in checks if not ok]

    def chat_template(self, tokenizer) -> bool:
        """Whether prompts go through the tokenizer's chat template: `auto` when it has one."""
        mode = str(self.use_chat_template).lower()
        has = bool(getattr(tokenizer, "chat_template", None))
        if mode == "true" and not has:
            raise ValueError("rollout.use_chat_template=true, but the model's tokenizer has no chat template; "
                             "use auto or false")
        return has if mode == "auto" else mode == "true"

    @property
    def groups_in_progress(self) -> int:
        return max(self.batch_size, round(self.batch_size * self.oversample))

    def sampling_params(self) -> dict:
        p = {"max_new_tokens": self.max_new_tokens, "temperature": self.temperature, "top_p": self.top_p,
             "top_k": self.top_k}
        if self.stop:
            p["stop"] = list(self.stop)
        if self.ignore_eos:
            p["ignore_eos"] = True
        return p
