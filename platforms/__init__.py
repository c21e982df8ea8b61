"""The one platform layer: which device Riptide runs on and what that means for every other part.

Nothing outside this package tests `torch.cuda` or `torch_npu` itself: it asks `platform_of(device)`
for the visible-devices variable, the Ray resource, the torch.distributed backend, the Mooncake
protocol and registration alignment, memory and synchronisation, and `choose_device` for the device.
"""
from __future__ import annotations

import os

import torch

from platforms.platform import CPU, CUDA, NPU, MooncakeArgs, Platform

__all__ = ["CPU", "CUDA", "NPU", "MooncakeArgs", "Platform", "PLATFORMS", "platform_of", "detect", "choose_device",
           "rank_device", "choose_dtype", "usable_cores", "dist_backend", "server_bundle"]

PLATFORMS = {p.device_type: p for p in (CPU, CUDA, NPU)}

_DTYPES = {
    "float32": torch.float32, "fp32": torch.float32,
    "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
    "float16": torch.float16, "fp16": torch.float16, "half": torch.float16,
}


def platform_of(device: torch.device | str) -> Platform:
    """The platform of a device (`cuda:1`, torch.device("npu"), ...); `auto` is this machine's."""
    kind = torch.device(device).type if isinstance(device, torch.device) else str(device).split(":")[0]
    if kind == "auto":
        return detect()
    if kind not in PLATFORMS:
        raise ValueError(f"device {device!r}: expected auto, cpu, cuda[:N] or npu[:N]")
    return PLATFORMS[kind]


def detect() -> Platform:
    """This machine's accelerator: CUDA, then an Ascend NPU (torch_npu), else the CPU."""
    for p in (CUDA, NPU):
        if p.is_available():
            return p
    return CPU


def usable_cores() -> int:
    """CPU cores this process may run on (its affinity mask, where the OS has one)."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)


def choose_device(name: str = "auto") -> torch.device:
    """`auto` picks cuda, then npu, then cpu; an explicit name must be usable here."""
    platform = platform_of(name)
    if not platform.is_available():
        what = "CUDA is not available" if platform is CUDA else "torch_npu is not installed or sees no NPU"
        raise ValueError(f"--device {name}: {what} on this machine; use --device cpu or auto")
    return torch.device(platform.device_type if name == "auto" else name)


def rank_device(name: str, local_rank: int) -> torch.device:
    """The device of a trainer rank: `choose_device(name)`, and on an accelerator the rank's own
    one (index `local_rank`, as torchrun numbers the processes of a machine) unless `name` gives one."""
    device = choose_device(name)
    platform = platform_of(device)
    if not platform.accelerator:
        return device
    if device.index is None:
        device = torch.device(device.type, local_rank)
    platform.set_device(device)
    return device


def dist_backend(device: torch.device | str) -> str:
    """torch.distributed's backend for ranks on `device`: gloo, nccl or hccl."""
    return platform_of(device).dist_backend


def choose_dtype(name: str, device: torch.device) -> torch.dtype:
    """`auto` is bfloat16 on accelerators and float32 on CPU (CPU half-precision matmuls are slow)."""
    if name == "auto":
        return torch.bfloat16 if platform_of(device).accelerator else torch.float32
    if name not in _DTYPES:
        raise ValueError(f"--dtype {name}: expected auto or one of {sorted(_DTYPES)}")
    return _DTYPES[name]


def server_bundle(device: str, cpus: float, tensor_parallel: int = 1) -> dict[str, float]:
    """Ray resources of one server replica: `cpus` CPUs, plus its accelerators (one per
    tensor-parallel rank) when it runs on one. `auto` means what this machine has (cluster nodes
    are assumed alike)."""
    return platform_of(device).bundle(cpus, tensor_parallel)
