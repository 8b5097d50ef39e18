# dsrl: `make train` and `make test` set everything up on first use.
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.dsrl-setup
ARGS ?=
PYTEST_ARGS ?=
export RAY_AUTH_MODE ?= disabled
export TORCH_EXTENSIONS_DIR ?= $(CURDIR)/.cache/torch_extensions

.PHONY: setup train train-2rank test test-fast bench-reuse bench-dtype bench-seeds bench-logprobs clean-outputs

setup: $(STAMP)

$(STAMP): launch/setup.sh launch/requirements.txt pyproject.toml
	bash launch/setup.sh

train: setup
	$(PY) -m dsrl.main +exp=grpo_reuse $(ARGS)

# Two ranks on one machine (gloo on CPU); DeepSpeed's launcher takes --module, not -m.
train-2rank: setup
	$(VENV)/bin/deepspeed --num_gpus 2 --master_port 29531 --module dsrl.main +exp=grpo_reuse $(ARGS)

test: setup
	$(PY) -m pytest -q $(PYTEST_ARGS)

test-fast: setup
	$(PY) -m pytest -q -m "not slow" $(PYTEST_ARGS)

bench-reuse: setup
	$(PY) bench/bench_reuse.py $(ARGS)

bench-dtype: setup
	$(PY) bench/bench_dtype.py $(ARGS)

bench-seeds: setup
	$(PY) bench/bench_seeded_sampling.py $(ARGS)

bench-logprobs: setup
	$(PY) bench/bench_logprobs.py $(ARGS)

clean-outputs:
	rm -rf outputs multirun

# The Tinker-compatible service (SDK 0.38): TINKER_BASE_URL=http://127.0.0.1:8000 TINKER_API_KEY=tml-dsrl-local
.PHONY: serve bench-serve
serve: setup
	$(PY) -m dsrl.serve +exp=tinker_service $(ARGS)

bench-serve: setup
	$(PY) bench/bench_serve.py $(ARGS)
