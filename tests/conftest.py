import os

import pytest

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# Ray reads this when it is imported: with it, every node of a test cluster stays on 127.0.0.1 (the
# nodes are started with node_ip_address="127.0.0.1"), never on the host's interface address.
os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory):
    """A small random Qwen2 checkpoint with a local tokenizer, saved with save_pretrained."""
    from inference_server.tiny_model import build_tiny_model
    return str(build_tiny_model(tmp_path_factory.mktemp("tiny"), hidden=128, layers=2, heads=4, kv_heads=2,
                                vocab=2000, max_positions=2048, seed=0))


@pytest.fixture(scope="session")
def tiny_model_v2(tmp_path_factory):
    """Same architecture and tokenizer, other random weights: a 'new version' of tiny_model."""
    from inference_server.tiny_model import build_tiny_model
    return str(build_tiny_model(tmp_path_factory.mktemp("tiny_v2"), hidden=128, layers=2, heads=4, kv_heads=2,
                                vocab=2000, max_positions=2048, seed=1))


@pytest.fixture(scope="session")
def hf_model(tiny_model):
    from transformers import AutoModelForCausalLM
    return AutoModelForCausalLM.from_pretrained(tiny_model, dtype="float32").eval()


def start_server(model_path, tmp_path_factory, *args):
    from inference_server.process import ServerProcess
    log = tmp_path_factory.mktemp("logs") / "server.log"
    return ServerProcess(model_path, args=["--context-length", "1024", *args], log_path=log).start()


@pytest.fixture(scope="module")
def server(tiny_model, tmp_path_factory):
    srv = start_server(tiny_model, tmp_path_factory)
    yield srv
    srv.stop()
