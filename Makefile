# Entry points (setup, demo and test are idempotent on a fresh clone):
#   make demo   sets up .venv, prepares shakespeare_char offline if needed, trains a small GPT on CPU
#   make test   sets up .venv with the test dependencies and runs the whole suite
#   make gpu-check  on a CUDA machine whose python3 already has torch and triton (no venv):
#               bench/gpu_check.py: the GPU tests, the one-LayerNorm table, training throughput of a
#               GPT-2 small (bfloat16, eager and compiled) against plain nanoGPT, and a short profile,
#               every result a file in GPU_OUT (default gpu-check/) with a summary
PY := .venv/bin/python
STAMP := .venv/.installed
RUNTIME_STAMP := .venv/.runtime-installed
# the CPUs this process may use: its affinity, and a container's CPU quota where one is set (torch's
# default counts the host's cores, and more threads than CPUs slows every step)
CPUS := $(shell python3 -c "import os, math; n = len(os.sched_getaffinity(0)); q = open('/sys/fs/cgroup/cpu.max').read().split() if os.path.exists('/sys/fs/cgroup/cpu.max') else ['max']; print(max(1, min(n, math.ceil(int(q[0]) / int(q[1])) if q[0] != 'max' else n)))" 2>/dev/null || echo 1)

.PHONY: setup demo test gpu-check clean

$(STAMP): requirements.txt requirements-dev.txt
	test -x $(PY) || python3 -m venv .venv
	$(PY) -m pip install --quiet --disable-pip-version-check -r requirements-dev.txt
	touch $(STAMP) $(RUNTIME_STAMP)

# the demo installs what it runs (requirements.txt), not the test dependencies
$(RUNTIME_STAMP): requirements.txt
	test -x $(PY) || python3 -m venv .venv
	$(PY) -m pip install --quiet --disable-pip-version-check -r requirements.txt
	touch $(RUNTIME_STAMP)

setup: $(STAMP)

demo: $(RUNTIME_STAMP)
	test -f data/shakespeare_char/train.bin || $(PY) data/shakespeare_char/prepare.py
	OMP_NUM_THREADS=$(CPUS) $(PY) train.py config/train_shakespeare_char_cpu.py
	$(PY) gns-analysis.py out-shakespeare-char-cpu

test: $(STAMP)
	$(PY) -m pytest -q -n 2 --dist worksteal tests

GPU_PY ?= python3
GPU_OUT ?= gpu-check
gpu-check:
	@$(GPU_PY) -c 'import torch, triton; assert torch.cuda.is_available()' 2>/dev/null || \
		{ echo 'gpu-check needs a CUDA GPU and a python with torch and triton; $(GPU_PY) lacks one of them (choose another with GPU_PY=...)'; exit 2; }
	$(GPU_PY) bench/gpu_check.py --out $(GPU_OUT)

clean:
	rm -rf out-* .pytest_cache
