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


def test_a_bucket_written_by_several_ranks_is_checked_range_by_range():
    """The parts digest of a sharded push: each rank's ranges with its own hashes, covering the bucket."""
    from weight_sync.bucket import digest, format_parts_digest, unpack_verified
    specs = [TensorSpec("a", "float32", (6, 4)), TensorSpec("b", "float32", (5,))]
    plan = plan_buckets(specs, bucket_bytes=4096)
    sent = {"a": torch.randn(6, 4), "b": torch.randn(5)}
    slot = torch.zeros(4096, dtype=torch.uint8)
    flat = torch.cat([sent["a"].reshape(-1), sent["b"]]).view(torch.uint8)
    slot[:flat.numel()] = flat
    ranges = [(0, 48), (48, 48), (96, 20)]          # rank 0's rows of a, rank 1's rows of a, rank 0's b
    good = format_parts_digest([(s, n, digest(slot[s:s + n])) for s, n in ranges], plan[0].nbytes)
    got = {"a": torch.zeros(6, 4), "b": torch.zeros(5)}
    assert unpack_verified(plan[0], slot, got, like=good) == good
    assert torch.equal(got["a"], sent["a"]) and torch.equal(got["b"], sent["b"])
    slot[50] ^= 1                                    # one byte of rank 1's range went wrong
    assert unpack_verified(plan[0], slot, got, like=good) != good
    with pytest.raises(ValueError, match="do not tile"):
        format_parts_digest([(0, 48, "x"), (50, 46, "y"), (96, 20, "z")], 116)
    with pytest.raises(ValueError, match="cover 96 of its 116"):
        format_parts_digest([(0, 48, "x"), (48, 48, "y")], 116)


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


def test_two_servers_both_flip_and_stale_versions_are_refused(fresh_server, new_model, hf_model):
    """Both flip; an older version is refused; the version they serve again is a no-op only with
    the weights that serve it: other weights under that version fail, naming it and the servers
    (a trainer that resumed and retrained a pushed step differently), and change nothing."""
    from weight_sync.sender import WeightSyncError
    a, b = fresh_server(), fresh_server()
    sync = sync_to(a.url, b.url)
    try:
        stats = sync.push(new_model, version=3)
        assert set(stats.stall_s) == {a.url, b.url} and stats.serving == {a.url: 3, b.url: 3}
        assert version(a.url) == version(b.url) == 3
        assert greedy(a.url)["output_ids"] == greedy(b.url)["output_ids"] == reference(new_model)
        with pytest.raises(WeightSyncError, match=f"version 3 is already served by {a.url}, {b.url} with other weights"):
            sync.push(hf_model, version=3)
        assert greedy(a.url)["output_ids"] == greedy(b.url)["output_ids"] == reference(new_model)
        again = sync.push(new_model, version=3)     # the version they serve, the same weights: nothing to send
        assert again.bytes == 0 and again.serving == {a.url: 3, b.url: 3}
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
    hop = 4.0
    try:
        sync = sync_to(live.url, frozen.url, timeout_s=hop)
        t0 = time.monotonic()
        with pytest.raises(WeightSyncError, match=frozen.url.replace(".", r"\.")):
            sync.push(new_model, version=1)
        # one hop timeout: the abort to the frozen server goes out in the background, not waited on
        assert time.monotonic() - t0 < 1.5 * hop
        assert version(live.url) == 0, "nobody flips unless the caller allows a partial update"
        sync.close()
        partial = sync_to(live.url, frozen.url, timeout_s=3, min_fraction=0.5)
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
    from inference_server.launch import EnginePort
    from weight_sync.clients import LocalReceiverClient
    from weight_sync.receiver import Receiver
    from weight_sync.sender import WeightSync
    from weight_sync.transports import InProcessTransport
    engine = Engine(EngineArgs(tiny_model, context_length=256))
    engine.start()
    transport = InProcessTransport()
    sync = WeightSync([LocalReceiverClient(Receiver(EnginePort(engine), lambda: transport))], transport=transport,
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


FREEZING_SENDER = textwrap.dedent("""
    import os, signal, sys
    from transformers import AutoModelForCausalLM
    from weight_sync.sender import WeightSync
    from weight_sync.transports import MooncakeTransport

    class FreezesMidPush(MooncakeTransport):
        writes = 0
        def write(self, peer, ops, timeout_s):
            FreezesMidPush.writes += 1
            if FreezesMidPush.writes == 3:        # a few buckets in: stop this whole process
                os.kill(os.getpid(), signal.SIGSTOP)
            return super().write(peer, ops, timeout_s)

    model = AutoModelForCausalLM.from_pretrained(sys.argv[2])
    sync = WeightSync(sys.argv[1].split(","), transport=FreezesMidPush(), bucket_bytes=int(sys.argv[3]), timeout_s=10)
    sync.push(model, version=1)
""")


def stopped(pid) -> bool:
    with open(f"/proc/{pid}/stat") as f:
        return f.read().rsplit(")", 1)[1].split()[0] == "T"


def wake_and_fail(zombie: subprocess.Popen, timeout_s: float = 120) -> None:
    """SIGCONT a frozen sender: its update was fenced off, so it ends with a WeightSyncError."""
    os.kill(zombie.pid, signal.SIGCONT)
    out, _ = zombie.communicate(timeout=timeout_s)
    assert zombie.returncode != 0, "the late sender's update cannot commit"
    assert b"WeightSyncError" in out, out.decode()[-3000:]


def reap(proc: subprocess.Popen) -> None:
    """A sender process this test started, killed (stopped or not) if it still runs."""
    if proc.poll() is None:
        os.kill(proc.pid, signal.SIGKILL)
        os.kill(proc.pid, signal.SIGCONT)
        proc.wait()


def fenced_after_newer_commit(a, b, zombie: subprocess.Popen, push_newer) -> None:
    """`zombie`, a sender that freezes mid-push of version 1 to servers a and b, wakes after
    `push_newer()` committed version 2 there: it fails, and version 2 serves unchanged."""
    try:
        assert wait_for(lambda: zombie.poll() is None and stopped(zombie.pid), 120), "the sender never froze"
        push_newer()
        committed = [live_digest(a.url), live_digest(b.url)]
        assert committed[0] == committed[1]
        wake_and_fail(zombie)
    finally:
        reap(zombie)
    assert version(a.url) == version(b.url) == 2
    assert [live_digest(a.url), live_digest(b.url)] == committed


def wait_for(predicate, timeout_s=60.0, every=0.2):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(every)
    return False


def test_late_sender_never_reaches_live_weights(fresh_server, tiny_model_v2, hf_model, tmp_path):
    """A sender frozen (SIGSTOP) mid-push of version 1 wakes after a fresh sender committed version
    2: its remaining writes and calls must not touch the weights that serve."""
    a, b = fresh_server(), fresh_server()
    script = tmp_path / "sender.py"
    script.write_text(FREEZING_SENDER)
    zombie = subprocess.Popen([sys.executable, str(script), f"{a.url},{b.url}", tiny_model_v2, str(BUCKET)],
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT)

    def push_newer():
        sync = sync_to(a.url, b.url)
        try:
            sync.push({n: p + 0.01 for n, p in hf_model.state_dict().items()}, version=2)
        finally:
            sync.close()
    fenced_after_newer_commit(a, b, zombie, push_newer)


class _FreezesAfterPrepare:
    """An HTTP receiver client that stops the receiver's process (SIGSTOP) once it has prepared."""

    def __new__(cls, url, pid, timeout_s):
        from weight_sync.clients import HttpReceiverClient

        class _C(HttpReceiverClient):
            def prepare(self, req):
                super().prepare(req)
                os.kill(pid, signal.SIGSTOP)
        return _C(url, timeout_s)


def test_split_commit_reaches_every_prepared_server(fresh_server, new_model, tmp_path):
    """One receiver frozen between prepare and commit: the push says who serves what; the frozen one
    commits once it wakes (nothing else: never the abort); pushing the same version again is a no-op."""
    from weight_sync.clients import HttpReceiverClient
    from weight_sync.sender import CommitIncomplete, WeightSync
    a, b = fresh_server(), fresh_server()
    before = live_digest(b.url)
    sync = WeightSync([HttpReceiverClient(a.url, 3), _FreezesAfterPrepare(b.url, b.proc.pid, 3)], bucket_bytes=BUCKET,
                      timeout_s=3)
    try:
        with pytest.raises(CommitIncomplete) as e:
            sync.push(new_model, version=1)
        assert e.value.stats.serving == {a.url: 1, b.url: 0} and list(e.value.stats.pending) == [b.url]
        assert b.url in str(e.value) and "push" in str(e.value)
        assert version(a.url) == 1
        assert stopped(b.proc.pid) and live_digest(a.url) != before
    finally:
        os.kill(b.proc.pid, signal.SIGCONT)
    assert wait_for(lambda: version(b.url) == 1, 60), "the frozen receiver never learned the commit"
    assert live_digest(b.url) == live_digest(a.url)
    again = sync_to(a.url, b.url)
    try:
        stats = again.push(new_model, version=1)
    finally:
        again.close()
        sync.close()
    assert stats.serving == {a.url: 1, b.url: 1} and stats.bytes == 0
    assert greedy(b.url)["output_ids"] == reference(new_model)


class _LosesCommit:
    """An HTTP receiver client whose commit never reaches the receiver (a lost message)."""

    def __new__(cls, url, timeout_s):
        from weight_sync.clients import HttpReceiverClient, ReceiverCallError

        class _C(HttpReceiverClient):
            def commit(self, req):
                raise ReceiverCallError(self.name, "/commit: connection reset (lost)")
        return _C(url, timeout_s)


@pytest.mark.parametrize("how", ["push_again", "ask_peers"])
def test_a_prepared_server_that_missed_the_commit_completes(fresh_server, new_model, how):
    """The commit to b is lost and the sender gives up on it (closed). Either the same version is
    pushed again, which completes b, or b, hearing nothing, asks its peer and commits on its own."""
    from weight_sync.clients import HttpReceiverClient
    from weight_sync.sender import CommitIncomplete, WeightSync
    a, b = fresh_server(), fresh_server()
    sync = WeightSync([HttpReceiverClient(a.url, 2), _LosesCommit(b.url, 2)], bucket_bytes=BUCKET, timeout_s=2)
    with pytest.raises(CommitIncomplete):
        sync.push(new_model, version=1)
    sync.close()
    assert httpx.get(f"{b.url}/weight_sync/status").json()["stage"] == "prepared" and version(b.url) == 0
    if how == "push_again":
        again = sync_to(a.url, b.url, timeout_s=2)
        try:
            stats = again.push(new_model, version=1)
        finally:
            again.close()
        assert stats.serving == {a.url: 1, b.url: 1} and stats.bytes > 0
    else:
        assert wait_for(lambda: version(b.url) == 1, 60), "b never asked its peer"
    assert version(b.url) == 1 and live_digest(b.url) == live_digest(a.url)
    assert greedy(b.url)["output_ids"] == reference(new_model)


def test_a_server_without_weights_is_not_counted_as_serving_a_version_it_never_committed(tiny_model, new_model,
                                                                                         tmp_path_factory):
    """A server started without weights under the label of the version being pushed (a cold vLLM
    server took its peer's label and reported it) prepares the push and loses the commit. It serves
    nothing, so the push must not count it as serving that version: CommitIncomplete, not success.
    (A cold vLLM server's push_to answered 200 this way while its commit had failed.) The embedded
    server reports -1 without weights; the client here reports the label, as that vLLM did."""
    from inference_server.process import ServerProcess
    from weight_sync.sender import CommitIncomplete, WeightSync
    cold = ServerProcess(tiny_model, args=["--context-length", "1024", "--no-weights", "--weight-version", "1"],
                         log_path=tmp_path_factory.mktemp("logs") / "cold.log").start(cold_ok=True)

    class ReportsItsLabel(type(_LosesCommit(cold.url, 2))):
        def open(self, req):
            return super().open(req).model_copy(update={"current_version": 1})
    try:
        sync = WeightSync([ReportsItsLabel(cold.url, 2)], bucket_bytes=BUCKET, timeout_s=2)
        with pytest.raises(CommitIncomplete) as e:
            sync.push(new_model, version=1)
        sync.close()
        assert e.value.stats.serving[cold.url] != 1
        assert httpx.get(f"{cold.url}/health").status_code == 503          # still no weights
    finally:
        cold.stop()


def test_receiver_refuses_every_illegal_transition(tiny_model):
    """idle -> open -> staged -> prepared -> committed | aborted, on a receiver in this process."""
    from inference_server.engine import Engine, EngineArgs
    from inference_server.launch import EnginePort
    from weight_sync import named_weights
    from weight_sync.bucket import pack, digest, plan_buckets, TensorSpec
    from weight_sync.protocol import (ApplyRequest, CommitRequest, ErrorKind, OpenRequest, PrepareRequest,
                                      UpdateRef)
    from weight_sync.receiver import Receiver, ReceiverError
    from weight_sync.transports import InProcessTransport, TransportError, WriteOp
    engine = Engine(EngineArgs(tiny_model, context_length=256))
    engine.start()
    transport = InProcessTransport()
    r = Receiver(EnginePort(engine), lambda: transport)
    tensors = {n: t.clone() for n, t in named_weights(engine.model).items()}
    local = torch.empty(BUCKET, dtype=torch.uint8)
    transport.register(local)

    def refused(kind, fn, *args):
        with pytest.raises(ReceiverError) as e:
            fn(*args)
        assert e.value.kind is kind, e.value

    def open_(version, uid):
        return r.open(OpenRequest(version=version, update_id=uid, bucket_bytes=BUCKET, num_slots=2, sender="t"))

    def apply(version, uid, reply, k):
        plan = plan_buckets([TensorSpec(s.name, s.dtype, tuple(s.shape)) for s in reply.specs], BUCKET)
        pack(plan[k], tensors, local)
        transport.write(reply.session, [WriteOp(local.data_ptr(), reply.slot_addrs[k % 2], plan[k].nbytes)], 5)
        r.apply(ApplyRequest(version=version, update_id=uid, bucket=k, slot=k % 2,
                             digest=digest(local[:plan[k].nbytes])))
        return len(plan)

    try:
        ref = dict(version=1, update_id="a")
        refused(ErrorKind.SUPERSEDED, r.apply, ApplyRequest(**ref, bucket=0, slot=0, digest="x"))   # idle
        refused(ErrorKind.SUPERSEDED, r.prepare, PrepareRequest(**ref))
        refused(ErrorKind.SUPERSEDED, r.commit, CommitRequest(**ref))
        refused(ErrorKind.CURRENT, open_, 0, "z")                        # the version it serves
        reply = open_(1, "a")
        assert r.stage.value == "open"
        refused(ErrorKind.INCOMPLETE, r.prepare, PrepareRequest(**ref))
        refused(ErrorKind.STATE, r.commit, CommitRequest(**ref))
        refused(ErrorKind.SUPERSEDED, r.apply, ApplyRequest(version=1, update_id="other", bucket=0, slot=0, digest="x"))
        refused(ErrorKind.DIGEST, r.apply, ApplyRequest(**ref, bucket=0, slot=0, digest="not-the-digest"))
        buckets = apply(1, "a", reply, 0)
        for k in range(1, buckets):
            apply(1, "a", reply, k)
        assert r.stage.value == "staged"
        r.prepare(PrepareRequest(**ref))
        r.prepare(PrepareRequest(**ref))                                # idempotent
        with pytest.raises(TransportError):                             # its slots are closed to writes
            apply(1, "a", reply, 0)
        refused(ErrorKind.STATE, r.apply, ApplyRequest(**ref, bucket=0, slot=0, digest="x"))
        assert r.commit(CommitRequest(**ref)).version == 1 and engine.version == 1
        assert r.commit(CommitRequest(**ref)).version == 1              # a retried commit: done already
        refused(ErrorKind.STATE, r.abort, UpdateRef(**ref))             # a commit cannot be undone
        assert r.stage.value == "idle"
        refused(ErrorKind.STALE, open_, 0, "old")
        first = open_(2, "b")
        second = open_(2, "c")                                          # the same version from a new sender
        assert set(first.slot_addrs).isdisjoint(second.slot_addrs)
        with pytest.raises(TransportError):                             # the replaced update's slots are closed
            apply(2, "b", first, 0)
        refused(ErrorKind.SUPERSEDED, r.apply, ApplyRequest(version=2, update_id="b", bucket=0, slot=0, digest="x"))
        open_(3, "d")
        refused(ErrorKind.STALE, open_, 2, "e")                         # older than the staged update
        r.abort(UpdateRef(version=3, update_id="d"))
        assert r.stage.value == "idle" and engine.version == 1
    finally:
        r.close()
        engine.shutdown()


def test_a_relay_push_gives_every_server_what_a_star_push_does(fresh_server, new_model, hf_model):
    """Three servers: a star push (the trainer writes every bucket to each) and relay pushes (chain,
    and a tree of fan-out 2: the trainer writes each bucket once, servers pass it on) leave the
    same weights everywhere; the trainer's egress is ~3x the model for the star, ~1x for a relay."""
    from weight_sync import live_digest as digest_of, named_weights
    servers = [fresh_server() for _ in range(3)]
    urls = [s.url for s in servers]
    model_bytes = sum(t.nbytes for t in named_weights(new_model).values())
    star = sync_to(*urls, topology="star")
    try:
        stats = star.push(new_model, version=1)
    finally:
        star.close()
    assert stats.egress_bytes == 3 * model_bytes
    after_star = [digest_of(named_weights(new_model))] * 3
    assert [live_digest(u) for u in urls] == after_star
    for v, (topology, model) in enumerate([("chain", hf_model), ("tree", new_model)], start=2):
        relay = sync_to(*urls, topology=topology, fan_out=2)
        try:
            stats = relay.push(model, version=v)
        finally:
            relay.close()
        assert stats.egress_bytes == model_bytes, topology
        assert [live_digest(u) for u in urls] == [digest_of(named_weights(model))] * 3, topology
        assert all(version(u) == v for u in urls)
    assert [live_digest(u) for u in urls] == after_star



class _Slots:
    """The receiver side of the fan-out as the scheduler sees it: slots that remember which bucket
    was written into them, an apply that checks its slot holds that bucket and forwards it, each
    after a random delay. In-process so thousands of interleavings run in seconds; the real
    receivers are in the relay test above."""

    def __init__(self, n, num_slots, seed, fail_at=None):
        import random
        self.rng, self.lock = random.Random(seed), threading.Lock()
        self.slot = [[None] * num_slots for _ in range(n)]
        self.got = [[] for _ in range(n)]
        self.fail_at = fail_at                       # (node, bucket): that apply fails (a dead relay)

    def nap(self):
        with self.lock:                              # now and then a slow one, so later buckets overtake
            s = self.rng.random() * 0.003 if self.rng.random() > 0.1 else 0.02
        time.sleep(s)

    def peer(self, i, num_slots):
        from types import SimpleNamespace
        from weight_sync.clients import ReceiverCallError
        from weight_sync.protocol import ApplyReply
        slots = self

        class Client:
            name = f"r{i}"

            def apply(self, req):
                slots.nap()
                if slots.fail_at == (i, req.bucket):
                    raise ReceiverCallError(self.name, "connection reset")
                assert slots.slot[i][req.slot] == req.bucket, f"r{i} slot {req.slot} was overwritten"
                slots.got[i].append(req.bucket)
                for t in req.forward:
                    slots.nap()
                    slots.slot[int(t.session)][t.addr] = req.bucket
                return ApplyReply()
        reply = SimpleNamespace(session=str(i), slot_addrs=list(range(num_slots)))
        return SimpleNamespace(client=Client(), reply=reply, error=None, name=f"r{i}")


@pytest.mark.parametrize("topology", ["star", "chain", "tree"])
def test_fanout_never_deadlocks_and_delivers_every_bucket_once(topology):
    """Buckets k and k + num_slots share a receiver slot while the trainer's ring holds more buckets
    than that: whatever order their writes interleave in, every bucket reaches every live receiver
    exactly once, in its slot's turn, also when a relay dies mid-push and its children move up."""
    from concurrent.futures import ThreadPoolExecutor
    from weight_sync.fanout import Fanout, Hop, tree_parents
    from weight_sync.protocol import UpdateRef
    n, num_slots, ring, buckets = 5, 2, 3, 30
    for seed in range(20):
        fail_at = (1, 7) if seed % 2 else None        # r1 relays to r3, r4 in a tree (r2 in a chain)
        slots = _Slots(n, num_slots, seed, fail_at)
        peers = [slots.peer(i, num_slots) for i in range(n)]

        def write(peer, local, k, nbytes):
            slots.nap()
            slots.slot[int(peer.reply.session)][k % num_slots] = k

        def drop(peer, error):
            peer.error = str(error)
        hop = Hop(write, drop, timeout_s=5, max_retries=0)
        with ThreadPoolExecutor(Fanout.pool_size(n, ring)) as pool:
            fan = Fanout(peers, tree_parents(n, topology, 2), num_slots, ring, UpdateRef(version=1, update_id="u"),
                         hop, pool)

            def push():
                moving = []
                for k in range(buckets):
                    fan.take_local(k)
                    moving.append(pool.submit(fan.bucket, k, 1, "d"))
                for f in moving:
                    f.result()
            pusher = threading.Thread(target=push, daemon=True)
            pusher.start()
            pusher.join(60)
            stuck = pusher.is_alive()
            if stuck:
                fan.failed = RuntimeError("stuck")       # every wait gives up, so the pool can close
        assert not stuck, f"{topology}, seed {seed}: the fan-out deadlocked"
        for i, p in enumerate(peers):
            if p.error is None:
                assert sorted(slots.got[i]) == list(range(buckets)), (topology, seed, i)
        assert (peers[1].error is not None) == (fail_at is not None)


def test_a_tree_chooses_its_fan_out_from_the_fleet_and_the_buckets():
    """A relay with f children sends every byte f times over its one link: with 4 servers and a
    13-bucket push the default tree is a chain (one copy per link, the pipeline 3 buckets longer);
    with 64 servers a chain's fill would cost more than a second copy per link, so fan-out 2. A
    fan-out set by hand is kept, and a negative one is named."""
    from weight_sync.fanout import TRAINER, best_fan_out, depth, tree_parents
    assert tree_parents(4, "tree", buckets=13) == tree_parents(4, "chain") == [TRAINER, 0, 1, 2]
    assert best_fan_out(64, 13) == 2 and depth(tree_parents(64, "tree", buckets=13)) == 7
    assert tree_parents(4, "tree", 2, buckets=13) == [TRAINER, 0, 0, 1]
    with pytest.raises(ValueError, match="fan_out=-1"):
        tree_parents(4, "tree", -1)


def test_a_push_after_a_failed_write_still_writes_in_place(fresh_server, new_model, hf_model):
    """A write that fails leaves its sources registered (a timed-out write may still read them);
    the next push writes the same tensors again without registering them twice (the bug: Mooncake
    refused the second registration and the job died at its next push after a link cut)."""
    from weight_sync.sender import WeightSync
    from weight_sync.transports import MooncakeTransport, TransportError
    a, b = fresh_server(), fresh_server()

    class FailsOnce(MooncakeTransport):
        failed = False

        def write(self, peer, ops, timeout_s):
            if not FailsOnce.failed and peer == self.victim:
                FailsOnce.failed = True
                raise TransportError(f"write to {peer} timed out (test)")
            return super().write(peer, ops, timeout_s)

    transport = FailsOnce()
    sync = WeightSync([a.url, b.url], transport=transport, bucket_bytes=BUCKET, min_fraction=0.5)
    try:
        transport.victim = httpx.post(f"{b.url}/weight_sync/open", json={   # b's transport session
            "version": 99, "update_id": "probe", "bucket_bytes": BUCKET, "num_slots": 1, "sender": "t"}).json()["session"]
        httpx.post(f"{b.url}/weight_sync/abort", json={"version": 99, "update_id": "probe"})
        first = sync.push(new_model, version=1)
        assert b.url in first.dropped and version(a.url) == 1
        sync.push(hf_model, version=2)
        third = sync.push(new_model, version=3)           # new_model's tensors: still registered since the failure
        assert third.serving == {a.url: 3, b.url: 3}
    finally:
        sync.close()
    assert live_digest(a.url) == live_digest(b.url)
    assert greedy(b.url)["output_ids"] == reference(new_model)
