"""Weight sync with real servers on loopback and the real Mooncake engine over TCP."""
import json
import os
import signal
import subprocess
import sys
import threading
import time
import textwrap

import httpx
import pytest
import torch

from tests.conftest import start_server
from weight_sync.bucket import TensorSpec, plan_buckets

pytest.importorskip("mooncake.engine")

BUCKET = 256 << 10   # small buckets: the 3.5 MB tiny model spans ~14, so the pipeline really runs


@pytest.fixture(scope="module")
def new_model(tiny_model_v2):
    from transformers import AutoModelForCausalLM
    return AutoModelForCausalLM.from_pretrained(tiny_model_v2, dtype="float32").eval()


@pytest.fixture
def fresh_server(tiny_model, tmp_path_factory):
    servers = []

    def make(*args):
        servers.append(start_server(tiny_model, tmp_path_factory, *args))
        return servers[-1]
    yield make
    for s in servers:
        s.stop()


def greedy(url, prompt=(21, 22, 23), n=12):
    r = httpx.post(f"{url}/generate", timeout=60, json={
        "input_ids": list(prompt), "sampling_params": {"max_new_tokens": n, "temperature": 0, "ignore_eos": True}})
    assert r.status_code == 200, r.text
    return r.json()


def reference(model, prompt=(21, 22, 23), n=12):
    return model.generate(torch.tensor([list(prompt)]), max_new_tokens=n, do_sample=False,
                          eos_token_id=None, pad_token_id=0)[0, len(prompt):].tolist()


def version(url):
    return int(httpx.get(f"{url}/get_weight_version").json()["weight_version"])


def live_digest(url):
    return httpx.get(f"{url}/weight_sync/digest", timeout=60).json()["digest"]


def sync_to(*urls, **kw):
    from weight_sync.sender import WeightSync
    return WeightSync(list(urls), bucket_bytes=kw.pop("bucket_bytes", BUCKET), **kw)


def test_plan_never_splits_a_tensor_that_fits():
    specs = [TensorSpec("a", "float32", (100,)), TensorSpec("b", "float32", (200,)),
             TensorSpec("big", "float32", (700,)), TensorSpec("c", "bfloat16", (10,))]
    plan = plan_buckets(specs, bucket_bytes=1200)
    assert [[p.name for p in b.pieces] for b in plan] == [["a", "b"], ["big"], ["big", ], ["big"], ["c"]]
    assert [p.length for p in plan[1].pieces + plan[2].pieces + plan[3].pieces] == [1200, 1200, 400]
    assert sum(b.nbytes for b in plan) == sum(s.nbytes for s in specs)
    with pytest.raises(ValueError, match="bucket_bytes"):
        plan_buckets(specs, 0)


def test_push_changes_what_the_server_generates(fresh_server, new_model, hf_model):
    srv = fresh_server()
    sync = sync_to(srv.url)
    try:
        stats = sync.push(new_model, version=1)
        assert stats.buckets > 3 and stats.bytes > 0 and stats.retries == 0 and stats.gbps > 0
        assert version(srv.url) == 1
        out = greedy(srv.url)
        assert out["output_ids"] == reference(new_model)
        assert out["meta_info"]["output_token_versions"] == [1] * 12
        assert srv.url in stats.stall_s
        # the two shadow buffers take turns: every later push lands whole as well
        for v, model in ((2, hf_model), (3, new_model), (4, hf_model)):
            sync.push(model, version=v)
            assert greedy(srv.url)["output_ids"] == reference(model) and version(srv.url) == v
    finally:
        sync.close()


def test_two_servers_both_flip_and_stale_versions_are_refused(fresh_server, new_model):
    from weight_sync.sender import WeightSyncError
    a, b = fresh_server(), fresh_server()
    sync = sync_to(a.url, b.url)
    try:
        stats = sync.push(new_model, version=3)
        assert set(stats.stall_s) == {a.url, b.url}
        assert version(a.url) == version(b.url) == 3
        assert greedy(a.url)["output_ids"] == greedy(b.url)["output_ids"] == reference(new_model)
        with pytest.raises(WeightSyncError, match="not newer"):
            sync.push(new_model, version=3)
        with pytest.raises(WeightSyncError, match="not newer"):
            sync.push(new_model, version=2)
    finally:
        sync.close()
    assert version(a.url) == version(b.url) == 3


KILLED_SENDER = textwrap.dedent("""
    import os, signal, sys, threading, time
    from transformers import AutoModelForCausalLM
    from weight_sync.sender import WeightSync
    from weight_sync.transports import MooncakeTransport

    class DiesMidTransfer(MooncakeTransport):
        writes = 0
        def write(self, peer, ops, timeout_s):
            DiesMidTransfer.writes += 1
            if DiesMidTransfer.writes == 4:      # bucket 3 is on the wire when the process dies
                threading.Thread(target=super().write, args=(peer, ops, timeout_s), daemon=True).start()
                time.sleep(0.001)
                os.kill(os.getpid(), signal.SIGKILL)
            return super().write(peer, ops, timeout_s)

    model = AutoModelForCausalLM.from_pretrained(sys.argv[2])
    WeightSync([sys.argv[1]], transport=DiesMidTransfer(), bucket_bytes=int(sys.argv[3])).push(model, version=1)
""")


def test_sender_killed_mid_transfer_leaves_servers_on_the_old_version(fresh_server, tiny_model_v2, new_model, tmp_path):
    a, b = fresh_server(), fresh_server()
    before = [live_digest(a.url), live_digest(b.url)]
    old_out = greedy(a.url)["output_ids"]
    script = tmp_path / "sender.py"
    script.write_text(KILLED_SENDER)
    for target in (a, b):
        proc = subprocess.run([sys.executable, str(script), target.url, tiny_model_v2, str(BUCKET)],
                              capture_output=True, timeout=120)
        assert proc.returncode == -signal.SIGKILL, proc.stderr.decode()[-2000:]
        status = httpx.get(f"{target.url}/weight_sync/status").json()
        assert status["staged_version"] == 1 and 0 < status["buckets_applied"] < status["buckets"]
    assert [live_digest(a.url), live_digest(b.url)] == before
    assert version(a.url) == version(b.url) == 0
    assert greedy(a.url)["output_ids"] == greedy(b.url)["output_ids"] == old_out
    sync = sync_to(a.url, b.url)          # a new sender retries the same version and wins
    try:
        sync.push(new_model, version=1)
    finally:
        sync.close()
    assert greedy(a.url)["output_ids"] == reference(new_model)


class CorruptingTransport:
    """The real Mooncake transport, plus a stray write that flips one byte in the receiver's slot
    right after chosen bucket writes land: corruption in transit, as the receiver sees it."""

    def __new__(cls, corrupt_writes):
        from weight_sync.transports import MooncakeTransport, WriteOp

        class _T(MooncakeTransport):
            def __init__(self):
                super().__init__()
                self.count = 0
                self.junk = torch.full((1,), 0xAB, dtype=torch.uint8)
                self.register(self.junk)

            def write(self, peer, ops, timeout_s):
                super().write(peer, ops, timeout_s)
                self.count += 1
                if self.count in corrupt_writes:
                    op = ops[0]
                    super().write(peer, [WriteOp(self.junk.data_ptr(), op.remote_addr + op.length // 2, 1)],
                                  timeout_s)
        return _T()


def test_corrupted_byte_is_detected_and_retried(fresh_server, new_model):
    from weight_sync.sender import WeightSync
    srv = fresh_server()
    sync = WeightSync([srv.url], transport=CorruptingTransport({2}), bucket_bytes=BUCKET)
    try:
        stats = sync.push(new_model, version=1)
    finally:
        sync.close()
    assert stats.retries == 1
    assert greedy(srv.url)["output_ids"] == reference(new_model)


def test_corruption_that_persists_refuses_the_update(fresh_server, new_model):
    from weight_sync.sender import WeightSync, WeightSyncError
    srv = fresh_server()
    before = live_digest(srv.url)
    sync = WeightSync([srv.url], transport=CorruptingTransport(set(range(1, 100))), bucket_bytes=BUCKET,
                      max_retries=2)
    try:
        with pytest.raises(WeightSyncError, match="digest"):
            sync.push(new_model, version=1)
    finally:
        sync.close()
    assert version(srv.url) == 0 and live_digest(srv.url) == before


def test_frozen_receiver_times_out_with_its_name(fresh_server, new_model):
    from weight_sync.sender import WeightSyncError
    live, frozen = fresh_server(), fresh_server()
    os.kill(frozen.proc.pid, signal.SIGSTOP)
    try:
        sync = sync_to(live.url, frozen.url, timeout_s=3)
        t0 = time.monotonic()
        with pytest.raises(WeightSyncError, match=frozen.url.replace(".", r"\.")):
            sync.push(new_model, version=1)
        assert time.monotonic() - t0 < 30
        assert version(live.url) == 0, "nobody flips unless the caller allows a partial update"
        stats = sync.push(new_model, version=1) if False else None
        sync.close()
        partial = sync_to(live.url, frozen.url, timeout_s=3, allow_partial=True)
        stats = partial.push(new_model, version=2)
        partial.close()
        assert frozen.url in stats.dropped and version(live.url) == 2
        assert greedy(live.url)["output_ids"] == reference(new_model)
    finally:
        os.kill(frozen.proc.pid, signal.SIGCONT)
    assert version(frozen.url) == 0


class Streamer(threading.Thread):
    def __init__(self, url, n=800):
        super().__init__()
        self.url, self.n, self.result, self.started = url, n, None, threading.Event()
        self.start()
        assert self.started.wait(60)

    def run(self):
        body = {"input_ids": [4, 5, 6], "stream": True, "return_logprob": True,
                "sampling_params": {"max_new_tokens": self.n, "ignore_eos": True}}
        with httpx.stream("POST", f"{self.url}/generate", json=body, timeout=120) as r:
            for line in r.iter_lines():
                if line.startswith("data: {"):
                    self.result = json.loads(line[6:])
                    self.started.set()


def test_requests_in_flight_complete_with_the_right_versions(fresh_server, new_model):
    srv = fresh_server()
    req = Streamer(srv.url)
    sync = sync_to(srv.url)
    try:
        sync.push(new_model, version=1, inflight="continue")
        req.join(60)
        meta = req.result["meta_info"]
        versions = meta["output_token_versions"]
        assert meta["finish_reason"]["type"] == "length" and len(versions) == 800
        assert versions[0] == 0 and versions[-1] == 1 and versions == sorted(versions)
        assert meta["kv_cache_weight_version"] == 0     # the prompt's KV cache came from the old weights
        req = Streamer(srv.url)
        stats = sync.push(new_model, version=2, inflight="abort")
        req.join(60)
        meta = req.result["meta_info"]
        assert meta["finish_reason"]["type"] == "abort" and stats.aborted_requests[srv.url] == 1
        assert set(meta["output_token_versions"]) == {1}
        assert len(meta["output_token_logprobs"]) == len(req.result["output_ids"]) > 0
    finally:
        sync.close()


def test_cold_start_pulls_weights_from_a_live_peer(fresh_server, new_model):
    peer = fresh_server()
    sync = sync_to(peer.url)
    try:
        sync.push(new_model, version=4)
    finally:
        sync.close()
    cold = fresh_server("--weights-from-peer", peer.url)
    assert version(cold.url) == 4
    assert live_digest(cold.url) == live_digest(peer.url)
    assert greedy(cold.url)["output_ids"] == reference(new_model)


def test_in_place_mode_flips_and_reports_the_stall(fresh_server, new_model):
    srv = fresh_server("--weight-sync-mode", "in_place")
    sync = sync_to(srv.url)
    try:
        stats = sync.push(new_model, version=1)
    finally:
        sync.close()
    assert stats.stall_s[srv.url] > 0
    assert httpx.get(f"{srv.url}/weight_sync/status").json()["mode"] == "in_place"
    assert greedy(srv.url)["output_ids"] == reference(new_model)


def test_colocated_push_through_the_in_process_transport(tiny_model, new_model):
    from inference_server.engine import Engine, EngineArgs
    from inference_server.sequence import SamplingParams, Sequence
    from weight_sync.clients import LocalReceiverClient
    from weight_sync.receiver import Receiver
    from weight_sync.sender import WeightSync
    from weight_sync.transports import InProcessTransport
    engine = Engine(EngineArgs(tiny_model, context_length=256))
    engine.start()
    transport = InProcessTransport()
    sync = WeightSync([LocalReceiverClient(Receiver(engine, lambda: transport))], transport=transport,
                      bucket_bytes=BUCKET)
    try:
        stats = sync.push(new_model, version=7)
        assert stats.version == 7 and engine.version == 7
        done = threading.Event()
        seq = Sequence("c", [21, 22, 23], SamplingParams(max_new_tokens=12, temperature=0, ignore_eos=True),
                       on_update=lambda s: s.finished and done.set())
        engine.add([seq])
        assert done.wait(30)
        assert seq.output_ids == reference(new_model) and set(seq.output_versions) == {7}
    finally:
        sync.close()
        engine.shutdown()
