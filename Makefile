# Entry points (setup, demo and test are idempotent on a fresh clone):
#   make demo   sets up .venv, prepares shakespeare_char offline if needed, trains a small GPT on CPU
#   make test   sets up .venv with the test dependencies and runs the whole suite
#   make gpu-check  on a CUDA machine whose python3 already has torch and triton (no venv):
#               the GPU kernels' tests, their timing against torch's LayerNorm, the tuning
#               sweep, and training throughput of a GPT-2 small (bfloat16, eager then compiled) against
#               plain nanoGPT: the paper's comparison in one command
PY := .venv/bin/python
STAMP := .venv/.installed

.PHONY: setup demo test gpu-check clean

$(STAMP): requirements.txt requirements-dev.txt
	test -x $(PY) || python3 -m venv .venv
	$(PY) -m pip install --quiet --disable-pip-version-check -r requirements-dev.txt
	touch $(STAMP)

setup: $(STAMP)

demo: $(STAMP)
	test -f data/shakespeare_char/train.bin || $(PY) data/shakespeare_char/prepare.py
	$(PY) train.py config/train_shakespeare_char_cpu.py
	$(PY) gns-analysis.py out-shakespeare-char-cpu

test: $(STAMP)
	$(PY) -m pytest -q -n 2 tests

GPU_PY ?= python3
gpu-check:
	@$(GPU_PY) -c 'import torch, triton; assert torch.cuda.is_available()' 2>/dev/null || \
		{ echo 'gpu-check needs a CUDA GPU and a python with torch and triton; $(GPU_PY) lacks one of them (choose another with GPU_PY=...)'; exit 2; }
	$(GPU_PY) -m pytest -q tests/test_normgnorm.py tests/test_fused_gns.py tests/test_bench_layernorm.py
	$(GPU_PY) bench/layernorm.py
	$(GPU_PY) bench/layernorm.py --sweep --iters 20
	$(GPU_PY) bench/throughput.py --device cuda --dtype bfloat16 --n_layer 12 --n_embd 768 --n_head 12 \
		--block_size 1024 --batch_size 8 --vocab_size 50304 --settings nn,ln-shim,ln-fused,all-gns --rounds 3 \
		--modes eager,compiled

clean:
	rm -rf out-* .pytest_cache
