"""Delta sync: only the bytes that changed, with real servers on loopback and the real Mooncake engine.

The servers hold bf16 weights (as real ones do) and the trainer fp32 master weights; each version
moves a small share of them across a bf16 rounding boundary, as a step at RL learning rates does.
"""
import signal
import subprocess
import sys
import textwrap

import httpx
import pytest
import torch

from tests.conftest import start_server
from weight_sync import live_digest as digest_of
from weight_sync.bucket import TensorSpec, pack, plan_buckets

pytest.importorskip("mooncake.engine")

BUCKET = 256 << 10
BF16 = ("--dtype", "bfloat16")


@pytest.fixture
def servers(tiny_model, tmp_path_factory):
    started = []

    def make(*args):
        started.append(start_server(tiny_model, tmp_path_factory, *BF16, *args))
        return started[-1]
    yield make
    for s in started:
        s.stop()


@pytest.fixture
def trainer(tiny_model):
    from transformers import AutoModelForCausalLM
    return AutoModelForCausalLM.from_pretrained(tiny_model, dtype="float32")


def step(model, seed, share=0.02):
    """Move `share` of every tensor's weights by a few bf16 ulps (as a training step would, at
    random places); the rest stays put."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            flat = p.view(-1)
            n = max(1, int(share * flat.numel()))
            at = torch.randperm(flat.numel(), generator=g)[:n]
            flat[at] += flat[at].abs().clamp_min(1e-3) * 0.05


def served_digest(url):
    return httpx.get(f"{url}/weight_sync/digest", timeout=60).json()["digest"]


def trainer_digest(model):
    return digest_of({n: p.detach().to(torch.bfloat16) for n, p in model.named_parameters()})


def sync_to(*urls, **kw):
    from weight_sync.sender import WeightSync
    return WeightSync(list(urls), bucket_bytes=kw.pop("bucket_bytes", BUCKET), delta=True, **kw)


def test_a_delta_rebuilds_every_dtype_bit_exactly_and_a_bad_one_is_undone():
    """Encode against a base, decode onto it (shadow: from the live copy; in place: onto the base
    itself), for bf16, fp32 and bool pieces in one bucket; a corrupted encoding is refused and in
    place mode puts every byte it wrote back."""
    from weight_sync.delta import DeltaBase, DeltaError, restore, unpack_delta
    specs = [TensorSpec("a", "bfloat16", (300, 700)), TensorSpec("b", "float32", (70001,)),
             TensorSpec("c", "bool", (13,))]
    plan = plan_buckets(specs, 1 << 20)
    old = {"a": torch.randn(300, 700).bfloat16(), "b": torch.randn(70001), "c": torch.rand(13) > 0.5}
    new = {k: v.clone() for k, v in old.items()}
    new["a"].view(-1)[torch.randperm(210000)[:2000]] += 0.5
    new["b"][70000] = 7.0
    new["c"][3] = ~new["c"][3]
    base, slot = DeltaBase(), torch.zeros(1 << 20, dtype=torch.uint8)
    for b in plan:
        pack(b, old, slot)
        base.take(b, old, slot)
    nbytes, dig = base.pack(plan[0], new, slot)
    assert dig == pack(plan[0], new, torch.empty(plan[0].nbytes, dtype=torch.uint8))
    assert nbytes < 0.05 * plan[0].nbytes and base.changed == 2002
    assert all(torch.equal(base.tensors[k], new[k]) for k in new)       # the base moved on

    shadow = {k: torch.empty_like(v) for k, v in old.items()}
    assert unpack_delta(plan[0], slot[:nbytes], shadow, base=old) == dig
    assert all(torch.equal(shadow[k], new[k]) for k in new)

    live, undo = {k: v.clone() for k, v in old.items()}, []
    bad = slot[:nbytes].clone()
    bad[-20:] ^= 0x5A                                                   # the last values
    try:
        got = unpack_delta(plan[0], bad, live, undo=undo)
    except DeltaError:                                                  # counts that no longer add up
        got = None
    assert got != dig and undo
    restore(undo)
    assert all(torch.equal(live[k], old[k]) for k in old)
    with pytest.raises(DeltaError, match="run past"):
        unpack_delta(plan[0], slot[:nbytes // 2], live)


@pytest.mark.parametrize("topology", ["star", "chain"])
def test_a_chain_of_deltas_with_a_late_joiner_keeps_every_server_bit_identical(servers, trainer, topology):
    """Star: the trainer writes each delta to every server; chain: a relays it to b (and to the late
    joiner, which gets the whole weights in a pass of its own)."""
    a, b = servers(), servers()
    sync = sync_to(a.url, b.url, topology=topology)
    try:
        first = sync.push(trainer, version=1)
        assert first.modes == {a.url: "full", b.url: "full"} and first.wire_fraction == 1.0
        for v in (2, 3):
            step(trainer, v)
            st = sync.push(trainer, version=v)
            assert st.modes == {a.url: "delta", b.url: "delta"}
            assert st.wire_fraction < 0.15 and 0 < st.changed_fraction < 0.1
            assert served_digest(a.url) == served_digest(b.url) == trainer_digest(trainer)
        late = servers()                                  # joins at version 0: it gets the whole weights
        sync.add_receiver(late.url)
        step(trainer, 4)
        st = sync.push(trainer, version=4)
        assert st.modes == {a.url: "delta", b.url: "delta", late.url: "full"}
        for v in (5, 6):
            step(trainer, v)
            st = sync.push(trainer, version=v)
            assert set(st.modes.values()) == {"delta"}
        want = trainer_digest(trainer)
        assert [served_digest(s.url) for s in (a, b, late)] == [want] * 3
        gen = [httpx.post(f"{s.url}/generate", timeout=60, json={
            "input_ids": [21, 22, 23], "sampling_params": {"max_new_tokens": 8, "temperature": 0}}).json()
            for s in (a, b, late)]
        assert len({tuple(g["output_ids"]) for g in gen}) == 1
        assert {str(g["meta_info"]["weight_version"]) for g in gen} == {"6"}
    finally:
        sync.close()


def test_a_server_not_on_the_base_gets_the_whole_weights(servers, trainer, tmp_path):
    """Reloaded from disk (the same version number even) or restarted: not the base, so whole."""
    a, b = servers(), servers()
    sync = sync_to(a.url, b.url)
    try:
        sync.push(trainer, version=1)
        trainer.save_pretrained(tmp_path / "ckpt")
        r = httpx.post(f"{b.url}/update_weights_from_disk", timeout=120,
                       json={"model_path": str(tmp_path / "ckpt"), "weight_version": 1})
        assert r.status_code == 200, r.text
        step(trainer, 2)
        st = sync.push(trainer, version=2)
        assert st.modes == {a.url: "delta", b.url: "full"}
        assert served_digest(a.url) == served_digest(b.url) == trainer_digest(trainer)
    finally:
        sync.close()


def test_a_delta_onto_another_base_is_refused(servers, trainer):
    """The receiver names the update that serves at open; a delta naming another is refused before
    a byte of it is read."""
    srv = servers()
    sync = sync_to(srv.url)
    try:
        sync.push(trainer, version=1)
    finally:
        sync.close()
    status = httpx.get(f"{srv.url}/weight_sync/status").json()
    assert status["live_update"]
    with httpx.Client(base_url=f"{srv.url}/weight_sync", timeout=30) as http:
        opened = http.post("/open", json={"version": 2, "update_id": "u2", "bucket_bytes": BUCKET, "num_slots": 2,
                                          "sender": "test"})
        assert opened.status_code == 200 and opened.json()["live_update"] == status["live_update"]
        r = http.post("/apply", json={"version": 2, "update_id": "u2", "bucket": 0, "slot": 0, "digest": "x",
                                      "encoding": "delta", "base_update": "some-other-update", "wire_bytes": 64})
        assert r.status_code == 409 and r.json()["kind"] == "base_mismatch", r.text
        assert "some-other-update" in r.json()["error"]
        http.post("/abort", json={"version": 2, "update_id": "u2"})
    assert served_digest(srv.url) == trainer_digest(trainer)


@pytest.mark.parametrize("mode", ["shadow", "in_place"])
def test_a_corrupted_delta_is_refused_and_written_again(servers, trainer, mode):
    from tests.test_weight_sync import CorruptingTransport
    from weight_sync.sender import WeightSync
    srv = servers("--weight-sync-mode", mode)
    corrupt: set[int] = set()
    transport = CorruptingTransport(corrupt)
    sync = WeightSync([srv.url], transport=transport, bucket_bytes=BUCKET, delta=True)
    try:
        sync.push(trainer, version=1)
        step(trainer, 2)
        transport.count = 0
        corrupt.update({1, 2})                 # a stray byte into the middle of the first two deltas
        st = sync.push(trainer, version=2)
    finally:
        sync.close()
    assert st.modes == {srv.url: "delta"} and st.retries >= 1
    assert served_digest(srv.url) == trainer_digest(trainer)


KILLED_DELTA_SENDER = textwrap.dedent("""
    import os, signal, sys, threading, time
    import torch
    from transformers import AutoModelForCausalLM
    from weight_sync.sender import WeightSync
    from weight_sync.transports import MooncakeTransport

    class DiesMidTransfer(MooncakeTransport):
        writes, armed = 0, False
        def write(self, peer, ops, timeout_s):
            if DiesMidTransfer.armed:
                DiesMidTransfer.writes += 1
                if DiesMidTransfer.writes == 3:    # the delta's third bucket is on the wire when it dies
                    threading.Thread(target=super().write, args=(peer, ops, timeout_s), daemon=True).start()
                    time.sleep(0.001)
                    os.kill(os.getpid(), signal.SIGKILL)
            return super().write(peer, ops, timeout_s)

    model = AutoModelForCausalLM.from_pretrained(sys.argv[2])
    sync = WeightSync(sys.argv[1].split(","), transport=DiesMidTransfer(), bucket_bytes=int(sys.argv[3]), delta=True)
    sync.push(model, version=1)
    print("pushed", flush=True)
    with torch.no_grad():
        for p in model.parameters():
            p.view(-1)[::50] += 0.01
    DiesMidTransfer.armed = True
    sync.push(model, version=2)
""")


def test_a_sender_killed_mid_delta_leaves_every_server_on_the_old_version(servers, tiny_model, tmp_path):
    a, b = servers(), servers()
    script = tmp_path / "sender.py"
    script.write_text(KILLED_DELTA_SENDER)
    proc = subprocess.run([sys.executable, str(script), f"{a.url},{b.url}", tiny_model, str(BUCKET)],
                          capture_output=True, timeout=180)
    assert proc.returncode == -signal.SIGKILL and b"pushed" in proc.stdout, proc.stderr.decode()[-2000:]
    v1 = served_digest(a.url)
    assert served_digest(b.url) == v1
    for s in (a, b):
        assert httpx.get(f"{s.url}/get_weight_version").json()["weight_version"] in (1, "1")
        status = httpx.get(f"{s.url}/weight_sync/status").json()
        assert status["stage"] in ("open", "staged", "aborted", "idle") and status["version"] == 1
