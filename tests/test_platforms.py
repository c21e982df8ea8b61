"""The platform layer on this CPU machine: the CPU platform for real, and the CUDA and NPU
descriptions with a stand-in for torch.cuda / torch.npu (a mock, because the device runtime
cannot run here; tests marked `gpu` run the real thing, see test_device.py). What is checked is
what each part of Riptide asks the platform for: Ray resources, the visible-devices variable,
torch.distributed's backend, Mooncake's protocol and registration alignment, device choice and
binding, and the KV cache sized from the device's free memory."""
from __future__ import annotations

import dataclasses

import pytest
import torch

import platforms
from platforms import CPU, CUDA, NPU

GiB = 1 << 30


class FakeRuntime:
    """Stands in for torch.cuda / torch.npu: `count` devices with `free` bytes free each."""

    def __init__(self, count: int = 4, free: int = 80 * GiB, total: int = 96 * GiB):
        self.count, self.free, self.total = count, free, total
        self.current = None
        self.synced = []

    def is_available(self):
        return self.count > 0

    def device_count(self):
        return self.count

    def set_device(self, device):
        self.current = str(device)

    def synchronize(self, device=None):
        self.synced.append(device)

    def mem_get_info(self, device=None):
        return self.free, self.total


@pytest.fixture
def fake(monkeypatch):
    """Make this machine look like it has `runtime`'s devices of platform `kind`."""
    def install(kind: str, runtime: FakeRuntime) -> platforms.Platform:
        platform = dataclasses.replace(platforms.PLATFORMS[kind], runtime=runtime)
        monkeypatch.setitem(platforms.PLATFORMS, kind, platform)
        monkeypatch.setattr(platforms, kind.upper(), platform)
        return platform
    return install


@pytest.mark.parametrize("platform, bundle, backend, visible, protocol, alignment", [
    (CPU, {"CPU": 2.0}, "gloo", {}, "tcp", 1),
    (CUDA, {"CPU": 2.0, "GPU": 2.0}, "nccl", {"CUDA_VISIBLE_DEVICES": "0,3"}, "tcp", 1),
    (NPU, {"CPU": 2.0, "NPU": 2.0}, "hccl", {"ASCEND_RT_VISIBLE_DEVICES": "0,3"}, "ascend_direct", 2 << 20),
])
def test_each_platform_names_its_ray_resource_backend_devices_and_transport(platform, bundle, backend, visible,
                                                                             protocol, alignment):
    assert platform.bundle(2, devices=2) == bundle
    assert platforms.server_bundle(platform.device_type, 2, tensor_parallel=2) == bundle
    assert platform.dist_backend == backend == platforms.dist_backend(platform.device_type)
    assert platform.visible_devices([0, 3]) == visible
    mooncake = platform.mooncake("auto")
    assert (mooncake.protocol, mooncake.alignment) == (protocol, alignment)
    assert platform.mooncake_wheel.startswith("mooncake-transfer-engine")


def test_a_gpu_given_nic_names_speaks_rdma_and_a_protocol_a_build_lacks_is_refused_by_name():
    assert CUDA.mooncake("auto", "mlx5_0,mlx5_1") == platforms.MooncakeArgs("rdma", "mlx5_0,mlx5_1", 1)
    assert CPU.mooncake("tcp").protocol == "tcp"
    with pytest.raises(ValueError, match="'ascend_direct'.*mooncake-transfer-engine .*tcp, rdma, nvlink"):
        CUDA.mooncake("ascend_direct")
    with pytest.raises(ValueError, match="'nvlink'.*npu"):
        NPU.mooncake("nvlink")


def test_this_machine_is_a_cpu_and_a_missing_accelerator_is_named():
    assert platforms.detect() is CPU
    assert platforms.choose_device("auto") == torch.device("cpu")
    assert platforms.choose_dtype("auto", torch.device("cpu")) == torch.float32
    with pytest.raises(ValueError, match="--device cuda:1: CUDA is not available"):
        platforms.choose_device("cuda:1")
    with pytest.raises(ValueError, match="--device npu: torch_npu is not installed"):
        platforms.choose_device("npu")
    with pytest.raises(ValueError, match="expected auto, cpu, cuda"):
        platforms.platform_of("tpu")


def test_a_trainer_rank_takes_its_own_accelerator_and_bf16(fake):
    cuda = fake("cuda", FakeRuntime(count=4))
    assert platforms.detect() is cuda
    assert platforms.rank_device("auto", 3) == torch.device("cuda", 3)
    assert cuda.runtime.current == "cuda:3"
    assert platforms.rank_device("cuda:1", 3) == torch.device("cuda", 1)      # named: kept
    assert platforms.choose_dtype("auto", torch.device("cuda")) == torch.bfloat16


def test_an_npu_binds_its_device_before_its_transfer_engine_starts(fake):
    npu = fake("npu", FakeRuntime(count=8))
    npu.before_transport("npu:5")
    assert npu.runtime.current == "npu:5"
    cuda = fake("cuda", FakeRuntime())
    cuda.before_transport(torch.device("cuda", 2))                  # nothing to do elsewhere
    assert cuda.runtime.current is None


def test_local_servers_each_get_their_own_accelerator(fake):
    from trainer_bridge.fleets.local import device_env
    fake("cuda", FakeRuntime(count=4))
    assert [device_env("cuda", i) for i in (0, 1, 5)] == [{"CUDA_VISIBLE_DEVICES": "0"}, {"CUDA_VISIBLE_DEVICES": "1"},
                                                          {"CUDA_VISIBLE_DEVICES": "1"}]
    assert device_env("cuda:2", 1) == {}                           # the user named one: all share it
    fake("npu", FakeRuntime(count=2))
    assert device_env("npu", 3) == {"ASCEND_RT_VISIBLE_DEVICES": "1"}
    assert device_env("cpu", 3) == {}


def test_the_kv_cache_on_an_accelerator_is_sized_from_its_free_memory(fake, tiny_model):
    from transformers import AutoConfig
    from inference_server.kv_cache import KV_MEMORY_FRACTION, kv_slots_that_fit
    cfg = AutoConfig.from_pretrained(tiny_model)        # 2 layers, 2 KV heads of 32: 512 B a position in bf16
    per_slot = 2 * 2 * 2 * 32 * 2 * 1024
    assert kv_slots_that_fit(64, cfg, 1024, torch.bfloat16, torch.device("cpu")) == 64
    cuda = fake("cuda", FakeRuntime(free=int(10.5 * per_slot / KV_MEMORY_FRACTION)))
    assert kv_slots_that_fit(64, cfg, 1024, torch.bfloat16, torch.device("cuda")) == 10
    assert kv_slots_that_fit(8, cfg, 1024, torch.bfloat16, torch.device("cuda")) == 8
    cuda.runtime.free = per_slot // 2
    with pytest.raises(ValueError, match="KV cache of one sequence at context 1024 .* lower --context-length"):
        kv_slots_that_fit(64, cfg, 1024, torch.bfloat16, torch.device("cuda"))


def test_staging_buffers_start_and_end_where_the_transport_needs():
    from weight_sync.bucket import host_buffer
    for nbytes, alignment in ((1000, 1), (1000, 2 << 20), ((2 << 20) + 1, 2 << 20)):
        buf = host_buffer(nbytes, alignment)
        assert buf.dtype == torch.uint8 and buf.is_contiguous()
        assert buf.data_ptr() % alignment == 0 and buf.numel() % alignment == 0 and buf.numel() >= nbytes
    assert CPU.memory(torch.device("cpu"))[0] > 0


def test_process_utilities_need_no_server():
    """platforms/process.py: a child in a session of its own is stopped with its group (SIGTERM,
    woken if frozen), killed at once by kill(); loopback hosts; a free port binds."""
    import os
    import signal
    import socket
    import sys

    from platforms.process import ChildProcess, free_port, is_loopback
    assert is_loopback("localhost") and is_loopback("127.0.0.2") and not is_loopback("10.0.0.1")
    assert not is_loopback("example.org")
    with socket.socket() as s:
        s.bind(("127.0.0.1", free_port()))
    child = ChildProcess()
    child.popen([sys.executable, "-c", "import time; time.sleep(60)"], {})
    os.kill(child.proc.pid, signal.SIGSTOP)
    child.stop(timeout=10)
    assert child.proc.returncode == -signal.SIGTERM
    child.popen([sys.executable, "-c", "import time; time.sleep(60)"], {})
    child.kill()
    assert child.proc.returncode == -signal.SIGKILL
