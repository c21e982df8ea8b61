"""The one place that decides which accelerator and dtype Riptide runs on."""
from __future__ import annotations

import importlib.util
import os

import torch

_DTYPES = {
    "float32": torch.float32, "fp32": torch.float32,
    "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
    "float16": torch.float16, "fp16": torch.float16, "half": torch.float16,
}


def usable_cores() -> int:
    """CPU cores this process may run on (its affinity mask, where the OS has one)."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)


def npu_available() -> bool:
    if importlib.util.find_spec("torch_npu") is None:
        return False
    import torch_npu  # noqa: F401  (registers torch.npu)
    return torch.npu.is_available()


def choose_device(name: str = "auto") -> torch.device:
    """`auto` picks cuda, then npu (torch_npu), then cpu; an explicit name must be usable."""
    if name == "auto":
        if torch.cuda.is_available():
            return torch.device("cuda")
        if npu_available():
            return torch.device("npu")
        return torch.device("cpu")
    kind = name.split(":")[0]
    if kind == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"--device {name}: CUDA is not available on this machine; use --device cpu or auto")
    if kind == "npu" and not npu_available():
        raise ValueError(f"--device {name}: torch_npu is not installed or sees no NPU; use --device cpu or auto")
    if kind not in ("cpu", "cuda", "npu"):
        raise ValueError(f"--device {name}: expected auto, cpu, cuda[:N] or npu[:N]")
    return torch.device(name)


def rank_device(name: str, local_rank: int) -> torch.device:
    """The device of a trainer rank: `choose_device(name)`, and on an accelerator the rank's own
    one (index `local_rank`, as torchrun numbers the processes of a machine) unless `name` gives one."""
    device = choose_device(name)
    if device.type == "cpu":
        return device
    if device.index is None:
        device = torch.device(device.type, local_rank)
    getattr(torch, device.type).set_device(device)
    return device


DIST_BACKEND = {"cuda": "nccl", "npu": "hccl"}     # torch.distributed's backend per device; gloo on CPU


def dist_backend(device: torch.device) -> str:
    return DIST_BACKEND.get(device.type, "gloo")


def choose_dtype(name: str, device: torch.device) -> torch.dtype:
    """`auto` is bfloat16 on accelerators and float32 on CPU (CPU half-precision matmuls are slow)."""
    if name == "auto":
        return torch.float32 if device.type == "cpu" else torch.bfloat16
    if name not in _DTYPES:
        raise ValueError(f"--dtype {name}: expected auto or one of {sorted(_DTYPES)}")
    return _DTYPES[name]


RAY_RESOURCE = {"cuda": "GPU", "npu": "NPU"}     # what Ray calls each accelerator


def server_bundle(device: str, cpus: float, tensor_parallel: int = 1) -> dict[str, float]:
    """Ray resources of one server replica: `cpus` CPUs, plus its accelerators (GPU or NPU, one per
    tensor-parallel rank) when it runs on one. `device` as the server takes it; `auto` means what
    this machine has (cluster nodes are assumed alike)."""
    kind = (choose_device("auto").type if device == "auto" else device.split(":")[0])
    bundle = {"CPU": float(cpus)}
    if kind in RAY_RESOURCE:
        bundle[RAY_RESOURCE[kind]] = float(tensor_parallel)
    return bundle
