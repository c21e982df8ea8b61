"""Groups of samples as padded tensors, on the trainer's side: what a trainer trains on."""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

import torch

from rollout.metrics import BatchMetrics
from rollout.types import Group, Sample


@dataclass
class Batch:
    """Groups as padded tensors, right-padded, prompt then response. Shapes: [batch, seq_len]."""
    input_ids: torch.Tensor
    attention_mask: torch.Tensor
    loss_mask: torch.Tensor           # 1 on response tokens the model generated
    behaviour_logprobs: torch.Tensor  # the server's logprob of each token given what precedes it (0 elsewhere)
    versions: torch.Tensor            # weight version per token (-1 on prompt and environment tokens)
    rewards: torch.Tensor             # [batch]
    group_index: torch.Tensor         # [batch]: which group a row belongs to
    samples: list[Sample]

    @classmethod
    def from_groups(cls, groups: list[Group], pad_id: int) -> "Batch":
        samples = [s for g in groups for s in g.samples]
        length = max(len(s.input_ids) for s in samples)
        shape = (len(samples), length)
        input_ids = torch.full(shape, pad_id, dtype=torch.long)
        attention, loss_mask = torch.zeros(shape, dtype=torch.long), torch.zeros(shape, dtype=torch.float32)
        logprobs, versions = torch.zeros(shape, dtype=torch.float32), torch.full(shape, -1, dtype=torch.long)
        for row, s in enumerate(samples):
            p, n = len(s.prompt_ids), len(s.input_ids)
            input_ids[row, :n] = torch.tensor(s.input_ids)
            attention[row, :n] = 1
            if s.response_ids:
                loss_mask[row, p:n] = torch.tensor(s.loss_mask, dtype=torch.float32)
                logprobs[row, p:n] = torch.tensor(s.logprobs)
                versions[row, p:n] = torch.tensor(s.versions)
        rewards = torch.tensor([s.reward for s in samples], dtype=torch.float32)
        group_index = torch.tensor([gi for gi, g in enumerate(groups) for _ in g.samples])
        return cls(input_ids, attention, loss_mask, logprobs, versions, rewards, group_index, samples)


@dataclass
class TrainBatch(Batch):
    """What `next_batch` hands a trainer: the padded groups (Batch; per-token tensors [batch, seq]),
    their GRPO advantages [batch] and the rollout's metrics for this batch."""
    advantages: torch.Tensor = None
    metrics: BatchMetrics = field(default_factory=BatchMetrics)

    def rows(self, rows: "slice | torch.Tensor") -> "TrainBatch":
        """A mini- or micro-batch: the same fields for rows `rows`, a slice or a tensor of row
        indices (metrics shared)."""
        def pick(value):
            if isinstance(value, list) and not isinstance(rows, slice):
                return [value[i] for i in rows.tolist()]
            return value[rows]
        return dataclasses.replace(self, **{f.name: pick(getattr(self, f.name)) for f in dataclasses.fields(self)
                                            if f.name != "metrics"})
