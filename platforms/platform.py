"""What Riptide needs to know about one kind of device, and the few calls it makes on it.

A `Platform` is a description (names: torch's device type, the visible-devices variable, Ray's
resource, torch.distributed's backend, the Mooncake protocols and wheel) plus `runtime`, the torch
module that drives the device (`torch.cuda`, `torch.npu`). The description is plain data, so the
CUDA and NPU platforms can be built and checked on a CPU machine; tests give them a stand-in
runtime where a call would need the hardware.
"""
from __future__ import annotations

import importlib
import importlib.util
from dataclasses import dataclass, field
from typing import Any

import torch

MiB = 1 << 20


@dataclass(frozen=True)
class MooncakeArgs:
    """How a Mooncake transfer engine starts: `initialize(host, "P2PHANDSHAKE", protocol, device_name)`;
    every registered buffer starts and ends on a multiple of `alignment` bytes."""
    protocol: str
    device_name: str = ""
    alignment: int = 1


@dataclass(frozen=True)
class Platform:
    device_type: str                       # torch's name: cpu, cuda, npu
    dist_backend: str                      # torch.distributed: gloo, nccl, hccl
    ray_resource: str | None               # what Ray calls one device: GPU, NPU (None: CPUs only)
    visible_devices_env: str | None        # the variable that picks a process's devices
    mooncake_protocols: tuple[str, ...]    # what Mooncake's build for this platform speaks
    mooncake_wheel: str                    # that build's wheel on PyPI
    fused_adamw: bool = True               # torch.optim.AdamW(fused=True) runs here
    torch_plugin: str | None = None        # the module that registers the device with torch (torch_npu)
    runtime: Any = field(default=None, compare=False, repr=False)   # stand-in for torch.<device_type>

    @property
    def accelerator(self) -> bool:
        return self.device_type != "cpu"

    # ---- the device runtime ---------------------------------------------------------------------
    def module(self):
        """torch.cuda / torch.npu (importing the plugin that registers it), or the stand-in."""
        if self.runtime is not None:
            return self.runtime
        if self.torch_plugin is not None:
            importlib.import_module(self.torch_plugin)
        return getattr(torch, self.device_type)

    def is_available(self) -> bool:
        if not self.accelerator:
            return True
        if self.runtime is None and self.torch_plugin and importlib.util.find_spec(self.torch_plugin) is None:
            return False
        return bool(self.module().is_available())

    def device_count(self) -> int:
        return self.module().device_count() if self.accelerator and self.is_available() else 0

    def set_device(self, device: torch.device) -> None:
        if self.accelerator:
            self.module().set_device(device)

    def synchronize(self, device: torch.device | None = None) -> None:
        if self.accelerator:
            self.module().synchronize(device)

    def memory(self, device: torch.device) -> tuple[int, int]:
        """(free, total) bytes of `device`: the accelerator's memory, or the host's for the CPU."""
        if self.accelerator:
            free, total = self.module().mem_get_info(device)
            return int(free), int(total)
        info = dict(line.split(":", 1) for line in open("/proc/meminfo"))
        kib = lambda key: int(info[key].split()[0]) * 1024  # noqa: E731
        return kib("MemAvailable"), kib("MemTotal")

    def copy_stream(self, device: torch.device):
        """A side stream for host<->device copies (None on the CPU: copies are plain memcpy)."""
        return self.module().Stream(device) if self.accelerator else None

    # ---- placement -------------------------------------------------------------------------------
    def visible_devices(self, ids: list[int]) -> dict[str, str]:
        """Environment that gives a process exactly these devices (numbered from 0 inside it)."""
        return {self.visible_devices_env: ",".join(map(str, ids))} if self.visible_devices_env else {}

    def bundle(self, cpus: float, devices: int = 1) -> dict[str, float]:
        """Ray resources of a process with `cpus` CPUs and, on an accelerator, `devices` of them."""
        out = {"CPU": float(cpus)}
        if self.ray_resource:
            out[self.ray_resource] = float(devices)
        return out

    # ---- weight-sync transport -------------------------------------------------------------------
    def mooncake(self, protocol: str = "auto", device_name: str = "") -> MooncakeArgs:
        """Mooncake's protocol and devices here. `auto`: the platform's default (rdma on a GPU when
        NIC names are given, else tcp; ascend_direct on an NPU)."""
        if protocol == "auto":
            protocol = self.mooncake_protocols[0]
            if self.device_type == "cuda" and device_name:
                protocol = "rdma"
        if protocol not in self.mooncake_protocols:
            raise ValueError(f"Mooncake protocol {protocol!r} is not one {self.mooncake_wheel} speaks on "
                             f"{self.device_type}: use auto or one of {', '.join(self.mooncake_protocols)}")
        # ascend_direct registers memory with the NPU driver, which maps it in 2 MiB pages.
        return MooncakeArgs(protocol, device_name, 2 * MiB if protocol == "ascend_direct" else 1)

    def before_transport(self, device: torch.device | str | None) -> None:
        """What must happen in a process before its Mooncake engine starts: on an NPU, the engine's
        ascend_direct transport binds to the current device, so that must be set first."""
        if self.device_type == "npu" and device is not None and str(device).split(":")[0] == "npu":
            self.set_device(device)


CPU = Platform("cpu", "gloo", None, None, ("tcp", "rdma"), "mooncake-transfer-engine-non-cuda")
CUDA = Platform("cuda", "nccl", "GPU", "CUDA_VISIBLE_DEVICES", ("tcp", "rdma", "nvlink"), "mooncake-transfer-engine")
NPU = Platform("npu", "hccl", "NPU", "ASCEND_RT_VISIBLE_DEVICES", ("ascend_direct", "ascend", "tcp"),
               "mooncake-transfer-engine-npu", fused_adamw=False, torch_plugin="torch_npu")
