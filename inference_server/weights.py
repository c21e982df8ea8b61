"""Read, check and swap in whole sets of weights by their checkpoint names."""
from __future__ import annotations

from pathlib import Path

import torch


def load_checkpoint(path: str | Path) -> dict[str, torch.Tensor]:
    """All tensors of a Hugging Face checkpoint directory (safetensors, else pytorch .bin)."""
    path = Path(path)
    if not path.is_dir():
        raise FileNotFoundError(f"model_path {str(path)!r} is not a directory")
    files = sorted(path.glob("*.safetensors"))
    if files:
        from safetensors.torch import load
        # Read the bytes now (not a lazy file mapping), so no page faults land in serving later.
        return {k: v for f in files for k, v in load(f.read_bytes()).items()}
    bins = sorted(path.glob("pytorch_model*.bin"))
    if bins:
        return {k: v for f in bins for k, v in torch.load(f, map_location="cpu", weights_only=True).items()}
    raise FileNotFoundError(f"model_path {str(path)!r} holds no *.safetensors or pytorch_model*.bin")


def parameters(model: torch.nn.Module) -> dict[str, torch.nn.Parameter]:
    """The model's parameters by checkpoint name; a tied weight appears once, under its first name."""
    return dict(model.named_parameters())


def match(model: torch.nn.Module, tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Tensors for every parameter, converted to its dtype and device; names what is missing or wrong."""
    params = parameters(model)
    missing = [n for n in params if n not in tensors]
    if missing:
        raise ValueError(f"weights lack {len(missing)} tensors the model needs, e.g. {missing[:3]}")
    out = {}
    for name, p in params.items():
        t = tensors[name]
        if tuple(t.shape) != tuple(p.shape):
            raise ValueError(f"tensor {name!r} has shape {tuple(t.shape)}, the model expects {tuple(p.shape)}")
        out[name] = t.to(device=p.device, dtype=p.dtype)
    return out


def swap_in(model: torch.nn.Module, tensors: dict[str, torch.Tensor]) -> list[torch.Tensor]:
    """Point each parameter at its new tensor: no copy, so serving stalls only for the swap.
    Returns the old tensors, so that the caller frees them outside the stall."""
    old = []
    for name, p in parameters(model).items():
        old.append(p.data)
        p.data = tensors[name]
    return old
