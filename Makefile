# Two entry points, both idempotent on a fresh clone:
#   make demo   sets up .venv, prepares shakespeare_char offline if needed, trains a small GPT on CPU
#   make test   sets up .venv with the test dependencies and runs the whole suite
PY := .venv/bin/python
STAMP := .venv/.installed

.PHONY: setup demo test clean

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
	$(PY) -m pytest -q tests

clean:
	rm -rf out-* .pytest_cache
