"""Riptide as a verl plugin (`make setup-verl`: verl 0.9.1 in .venv-verl, which `make test` runs these in).
verl's PPO loop needs GPUs; as verl's own `*_on_cpu.py` tests do, these drive its parts directly on
CPU: the plugin's registration by entry point, the server handle's generate contract on a tiny
model, and the checkpoint engine under the calling sequence of verl's CheckpointEngineManager."""
from __future__ import annotations

import asyncio
import subprocess
import sys

import httpx
import pytest
import torch

pytest.importorskip("verl", reason="verl is not installed here: `make setup-verl` makes .venv-verl, and "
                                   "`make test` runs this file there")


def test_importing_verl_registers_riptides_replica_engine_and_rollout_class():
    code = ("import verl\n"
            "from verl.checkpoint_engine.base import CheckpointEngineRegistry\n"
            "from verl.workers.rollout.replica import RolloutReplicaRegistry\n"
            "from verl.workers.rollout.base import get_rollout_class\n"
            "print(CheckpointEngineRegistry.get('riptide').__name__, RolloutReplicaRegistry.get('riptide').__name__,"
            " get_rollout_class('riptide', 'async').__name__)\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.split() == ["RiptideCheckpointEngine", "RiptideReplica", "RiptideServerAdapter"]


def test_server_handle_answers_verls_generate_contract(tiny_model, hf_model):
    from verl.workers.rollout.replica import TokenOutput

    from trainer_bridge.integrations.verl import RiptideServer
    server = RiptideServer(tiny_model, response_length=16)

    async def calls():
        prompt = [11, 12, 13, 14, 15]
        sampling = dict(temperature=0.0, top_p=1.0, top_k=-1, repetition_penalty=1.0, logprobs=True, max_tokens=8)
        out = await server.generate(prompt, dict(sampling), request_id="req-1")
        again = await server.generate(prompt, dict(sampling), request_id="req-2")
        assert isinstance(out, TokenOutput) and out.stop_reason == "completed"
        assert 1 <= len(out.token_ids) <= 8 and len(out.log_probs) == len(out.token_ids)
        assert out.token_ids == again.token_ids                        # greedy
        assert out.extra_fields["weight_versions"] == [0] * len(out.token_ids)
        # the logprobs are the model's: the same tokens scored by the checkpoint through transformers
        ids = torch.tensor([prompt + out.token_ids])
        with torch.no_grad():
            logp = torch.log_softmax(hf_model(ids).logits[0, len(prompt) - 1:-1].float(), -1)
        want = logp.gather(-1, torch.tensor(out.token_ids)[:, None])[:, 0]
        assert torch.allclose(torch.tensor(out.log_probs), want, atol=1e-3)
        # no max_tokens: the replica's response_length; repetition penalties refused by name
        assert len((await server.generate(prompt, {"temperature": 1.0}, request_id="req-3")).token_ids) <= 16
        with pytest.raises(ValueError, match="repetition_penalty"):
            await server.generate(prompt, {"repetition_penalty": 1.2}, request_id="req-4")
        for call in ("abort_all_requests", "resume_generation", "release_kv_cache", "resume_kv_cache", "sleep",
                     "wake_up", "clear_kv_cache"):
            await getattr(server, call)()
        await server.close()
    try:
        asyncio.run(calls())
    finally:
        server.shutdown()


def test_checkpoint_engine_moves_a_model_into_riptide_servers_bit_exactly_under_verls_calling_sequence(
        tiny_model, tiny_model_v2, tmp_path_factory):
    """CheckpointEngineManager.update_weights, step by step: prepare on every actor and rollout
    worker, build_topology over their metadata, init_process_group with each its own kwargs, the
    actor ranks' send_weights next to the rollout workers' receive_weights (through the server
    adapter, as verl's worker does), finalize. Two steps, so the engine is reused as verl reuses it."""
    from transformers import AutoModelForCausalLM

    from inference_server.process import ServerProcess
    from trainer_bridge.integrations.verl import RiptideCheckpointEngine, RiptideServerAdapter

    logs = tmp_path_factory.mktemp("verl-logs")
    servers = [ServerProcess(tiny_model, args=["--context-length", "512"], log_path=logs / f"s{i}.log").start()
               for i in range(2)]
    reference = ServerProcess(tiny_model_v2, args=["--context-length", "512"], log_path=logs / "ref.log").start()
    try:
        def digest(url):
            return httpx.get(f"{url}/weight_sync/digest", timeout=60).json()["digest"]
        new = AutoModelForCausalLM.from_pretrained(tiny_model_v2, dtype=torch.float32)
        old = AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float32)
        bucket = 1 << 20
        actors = [RiptideCheckpointEngine(bucket, is_master=(rank == 0)) for rank in range(2)]
        rollouts = [RiptideCheckpointEngine(bucket, server_url=s.url) for s in servers]
        adapter = RiptideServerAdapter.__new__(RiptideServerAdapter)       # verl builds it from its configs

        async def update(model, step):
            metadata = [e.prepare() for e in actors + rollouts]
            actor_kw, rollout_kw = RiptideCheckpointEngine.build_topology(len(actors), len(rollouts), metadata)
            for group, kw in ((actors, actor_kw), (rollouts, rollout_kw)):
                for i, engine in enumerate(group):
                    engine.init_process_group(**{k: v[i] for k, v in kw.items()})
            weights = lambda: ((n, p.detach()) for n, p in model.named_parameters())   # noqa: E731
            results = await asyncio.gather(*(a.send_weights(weights(), global_steps=step) for a in actors),
                                           *(adapter.update_weights(r.receive_weights(global_steps=step))
                                             for r in rollouts))
            for engine in actors + rollouts:
                engine.finalize()
            return results[0]

        metrics = asyncio.run(update(new, 1))
        assert metrics["riptide/servers"] == 2 and metrics["riptide/push_bytes"] > 0
        assert [digest(s.url) for s in servers] == [digest(reference.url)] * 2     # bit-exact, both servers
        assert [int(httpx.get(f"{s.url}/get_weight_version").json()["weight_version"]) for s in servers] == [1, 1]
        asyncio.run(update(old, 2))                                                # the engine again, other weights
        assert digest(servers[0].url) == digest(servers[1].url) != digest(reference.url)
    finally:
        actors[0].close()
        for s in servers + [reference]:
            s.stop()


def test_an_unmerged_lora_model_is_refused_by_name_before_any_byte_moves(tiny_model):
    """verl's checkpoint-engine path sends a LoRA model with lora.merge=False as its base alone (peft's
    `.base_layer.` names, verl's collect_lora_params): served, the policy would be the base's. The
    engine refuses it, naming the setting that sends the merged weights, and opens no update."""
    peft = pytest.importorskip("peft")
    from transformers import AutoModelForCausalLM
    from verl.utils.fsdp_utils import collect_lora_params, replace_lora_wrapper

    from inference_server.process import ServerProcess
    from trainer_bridge.integrations.verl import RiptideCheckpointEngine
    model = peft.get_peft_model(AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float32),
                                peft.LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"]))
    config = model.peft_config["default"]
    as_verl_sends = {replace_lora_wrapper(k, config): v
                     for k, v in collect_lora_params(model, layered_summon=False, base_sync_done=False).items()}
    assert any(".base_layer." in k for k in as_verl_sends)
    with ServerProcess(tiny_model, args=["--context-length", "512"]) as server:
        engine = RiptideCheckpointEngine(1 << 20, is_master=True)
        engine.init_process_group(0, [server.url])
        try:
            with pytest.raises(ValueError, match=r"unmerged LoRA model.*lora.merge=True"):
                asyncio.run(engine.send_weights(iter(as_verl_sends.items()), global_steps=1))
        finally:
            engine.close()
        assert httpx.get(f"{server.url}/weight_sync/status").json()["stage"] == "idle"
        assert int(httpx.get(f"{server.url}/get_weight_version").json()["weight_version"]) == 0


def test_replica_launches_its_server_as_a_ray_actor_that_verl_reaches_by_handle_and_by_name(tiny_model):
    """RiptideReplica.launch_servers on a real Ray cluster (one node on 127.0.0.1): the server handle
    generates, the replica's control calls reach it, and a rollout worker of that replica finds its
    server by the actor's name (what the checkpoint engine's prepare reports)."""
    import ray
    from ray.cluster_utils import Cluster
    from verl.workers.config import HFModelConfig, RolloutConfig
    from verl.workers.rollout.replica import RolloutReplicaRegistry, TokenOutput

    from trainer_bridge.integrations import verl as plugin
    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 2, "include_dashboard": False,
                                                            "node_ip_address": "127.0.0.1",
                                                            "object_store_memory": 80 << 20})
    ray.init(address=cluster.address, log_to_driver=False)
    replica = None
    try:
        config = RolloutConfig(name="riptide", response_length=8, prompt_length=16, tensor_model_parallel_size=1)
        replica = RolloutReplicaRegistry.get("riptide")(replica_rank=0, config=config,
                                                       model_config=HFModelConfig(path=tiny_model, local_path=tiny_model),
                                                       gpus_per_node=1)

        async def run():
            await replica.launch_servers()
            out = await replica.server_handle.generate.remote([11, 12, 13], {"temperature": 0.0}, "r-1")
            await replica.abort_all_requests()
            await replica.resume_generation()
            await replica.sleep()
            await replica.wake_up()
            return out
        out = asyncio.run(run())
        assert isinstance(out, TokenOutput) and 1 <= len(out.token_ids) <= 8
        assert httpx.get(f"{replica.server_address}/health", timeout=10).status_code == 200
        plugin.LOCAL_SERVERS.clear()
        plugin.LOCAL_REPLICA[:] = [0]
        assert plugin.RiptideCheckpointEngine(1 << 20).prepare() == {"server_url": replica.server_address}
    finally:
        plugin.LOCAL_SERVERS.clear()
        plugin.LOCAL_REPLICA.clear()
        if replica is not None and replica.servers:
            ray.get(replica.servers[0].shutdown.remote())
        ray.shutdown()
        cluster.shutdown()
