# dsrl: `make train` and `make test` set everything up on first use.
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.dsrl-setup
ARGS ?=
PYTEST_ARGS ?=
# Two pytest workers (pytest-xdist): a test file stays on one worker, the heaviest files start first
# (tests/conftest.py); TEST_WORKERS=0 runs the suite in this one process. Each worker and what it
# starts runs on its own share of the cores; TEST_PIN=0 leaves them unpinned.
TEST_WORKERS ?= 2
export TEST_PIN ?= 1
XDIST = $(if $(filter 0,$(TEST_WORKERS)),,-n $(TEST_WORKERS) --dist loadfile --no-loadscope-reorder)
export RAY_AUTH_MODE ?= disabled
export TORCH_EXTENSIONS_DIR ?= $(CURDIR)/.cache/torch_extensions

.PHONY: setup train train-reasoning train-2rank test test-fast docs bench-reuse bench-train bench-critic bench-dtype bench-seeds bench-logprobs bench-overlap bench-overlap-learn bench-async bench-async-learn bench-rollout bench-step bench-sync bench-lora bench-ceiling clean-outputs

setup: $(STAMP)

$(STAMP): launch/setup.sh launch/requirements.txt launch/requirements-verifiers.txt pyproject.toml
	bash launch/setup.sh

train: setup
	$(PY) -m dsrl.main +exp=grpo_reuse $(ARGS)

# GSM8K word problems, 256 new tokens (conf/exp/gsm8k_reasoning.yaml; docs/benchmarks.md "GSM8K reasoning preset").
train-reasoning: setup
	$(PY) -m dsrl.main +exp=gsm8k_reasoning $(ARGS)

# Two ranks on one machine (gloo on CPU); DeepSpeed's launcher takes --module, not -m.
train-2rank: setup
	$(VENV)/bin/deepspeed --num_gpus 2 --master_port 29531 --module dsrl.main +exp=grpo_reuse $(ARGS)

test: setup
	$(PY) -m pytest -q $(XDIST) $(PYTEST_ARGS)

test-fast: setup
	$(PY) -m pytest -q $(XDIST) -m "not slow" $(PYTEST_ARGS)

# The documentation site (mkdocs.yml) into site/, strict: a broken link, a missing page or a config key
# that is not in dsrl/config/schema.py fails the build; the configuration reference is generated.
docs: setup
	NO_MKDOCS_2_WARNING=1 $(VENV)/bin/mkdocs build --strict --quiet

bench-reuse: setup
	$(PY) bench/bench_reuse.py $(ARGS)

bench-train: setup
	$(PY) bench/bench_train.py $(ARGS)

bench-critic: setup
	$(PY) bench/bench_critic.py $(ARGS)

bench-dtype: setup
	$(PY) bench/bench_dtype.py $(ARGS)

bench-seeds: setup
	$(PY) bench/bench_seeded_sampling.py $(ARGS)

bench-logprobs: setup
	$(PY) bench/bench_logprobs.py $(ARGS)

# Rollout speed: dsrl's vLLM-CPU engine settings vs dsrl's earlier ones (bench/bench_rollout.py) vs transformers generate
# (ARGS="bench.knobs=1": each engine knob alone; "bench.mismatch=1": rollout vs trainer log-probs).
bench-rollout: setup
	$(PY) bench/bench_rollout.py $(ARGS)

# Whole step, every speed-up on vs all off, and TRL's GRPOTrainer (its own venv), steps interleaved.
bench-step: setup
	$(PY) bench/bench_step.py $(ARGS)

# One-step-off-policy overlap vs the synchronous loop (step-time ratio, interleaved), and the
# full default job with overlap (does it learn? last5 - first5 >= 0.4).
bench-overlap: setup
	$(PY) bench/bench_overlap.py $(ARGS)

bench-overlap-learn: setup
	$(PY) bench/bench_overlap.py bench.learn=1 $(ARGS)

# Asynchronous rollouts (algo.off_policy_steps=k, clock | deterministic) against the synchronous loop
# and the one-step overlap, trainer and engine pinned to separate cores; bench-async-learn: the
# 30-step default job under k = 2 (last5 - first5 reward >= 0.4?).
bench-async: setup
	$(PY) bench/bench_async.py $(ARGS)

bench-async-learn: setup
	$(PY) bench/bench_async.py --learn $(ARGS)

# LoRA (actor.lora.rank=8) vs full-parameter training: step time, sync bytes, trainer peak RSS as
# ratios (interleaved); tiny model by default, ARGS="bench.model=smollm2" for SmolLM2-135M.
bench-lora: setup
	$(PY) bench/bench_lora.py $(ARGS)

# Weight sync through shared memory vs the old safetensors-file push, vs memcpy, 1 and 2 engines
# (ARGS="bench.model=tiny bench.dtypes=float32 bench.rounds=3 bench.bucket_mb=256").
bench-sync: setup
	$(PY) bench/bench_sync.py $(ARGS)

# The default job's train phase, scoring forward and rollout against this machine's ceiling (the
# phase's own matrix multiplies replayed alone; the engine's plain generate on the same requests);
# ARGS="bench.profile=1" adds a torch.profiler table of one train phase (operators, dsrl functions).
bench-ceiling: setup
	$(PY) bench/bench_ceiling.py $(ARGS)

# GPU smoke checks (docs/guides/gpu.md): trainer level (torch + deepspeed only), then the vLLM level;
# each prints "no CUDA device: skipped" and exits 0 on a machine without a GPU.
.PHONY: gpu-smoke
gpu-smoke: setup
	bash launch/gpu_smoke.sh trainer && bash launch/gpu_smoke.sh vllm

clean-outputs:
	rm -rf outputs multirun

# The Tinker-compatible service (SDK 0.38): TINKER_BASE_URL=http://127.0.0.1:8000 TINKER_API_KEY=tml-dsrl-local
.PHONY: serve bench-serve
serve: setup
	$(PY) -m dsrl.serve +exp=tinker_service $(ARGS)

bench-serve: setup
	$(PY) bench/bench_serve.py $(ARGS)
