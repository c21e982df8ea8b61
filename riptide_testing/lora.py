"""LoRA adapters as training leaves them, for tests and benches (peft: the lora extra)."""
from __future__ import annotations

import torch


def draw_adapter(model, seed: int, std: float) -> torch.nn.Module:
    """`model`'s LoRA B matrices drawn anew from N(0, std) (a fresh adapter's B is 0: it computes
    nothing); A and the frozen base are left as they are."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.copy_(torch.randn(p.shape, generator=g) * std)
    return model
