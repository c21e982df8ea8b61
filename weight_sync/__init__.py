"""Weight sync: stream a trainer's new weights into running inference servers, verified, two-phase."""
from __future__ import annotations

import torch


def weights_of(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """A model's parameters by checkpoint name (a tied weight once), as plain tensors."""
    return {n: p.detach() for n, p in model.named_parameters()}
