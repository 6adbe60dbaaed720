# `make test` and `make demo` set themselves up: a .venv at the repo root, the package installed (editable) with
# the pinned versions in constraints.txt. The stamp files re-run the install only when the pins or metadata change.
# `make demo` alone installs no torchao (the qlora extra): transformers imports torchao whenever it is installed, and
# torchao's PyPI wheels print load failures of their CUDA kernels beside a CPU build of torch, so a first run that
# needs no quantization stays quiet. `make test` adds the test and qlora extras, and LitGPT for the test that runs its
# own recipe (tests/integration/test_litgpt.py), and Ray Train for its Lightning recipe (tests/integration/test_ray.py):
# LitGPT without its dependencies (`--no-deps`), since its pin of
# huggingface_hub (< 1.4) excludes the one transformers 5 needs; what its recipe imports is the `litgpt` extra.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
DEMO_STAMP := $(VENV)/.installed-demo
PYTEST_ARGS ?=

.PHONY: test demo bench gpu-check clean

$(PY):
	$(PYTHON) -m venv $(VENV)

$(STAMP): $(PY) pyproject.toml constraints.txt
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -c constraints.txt -e ".[test,demo,qlora,litgpt,ray]"
	$(PY) -m pip install --quiet --no-deps -c constraints.txt litgpt
	touch $(STAMP) $(DEMO_STAMP)

$(DEMO_STAMP): $(PY) pyproject.toml constraints.txt
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -c constraints.txt -e ".[demo]"
	touch $(DEMO_STAMP)

test: $(STAMP)
	$(PY) -m pytest $(PYTEST_ARGS)

demo: $(DEMO_STAMP)
	$(PY) examples/lora_finetune.py

# Benchmarks (about 2 hours on 2 CPU cores): results in benchmarks/results/, tables in docs/performance.md.
bench: $(STAMP)
	$(PY) benchmarks/real_model.py --repeats 3
	$(PY) benchmarks/real_model.py --nf4 --repeats 3
	$(PY) benchmarks/throughput.py --repeats 3
	$(PY) benchmarks/throughput.py --scaling --repeats 2
	$(PY) benchmarks/throughput.py --knobs --repeats 2
	$(PY) benchmarks/throughput.py --tensor-parallel --repeats 2
	$(PY) benchmarks/expert_parallel.py --repeats 2
	$(PY) benchmarks/expert_parallel.py --repeats 2 --lora
	$(PY) benchmarks/context_parallel.py --longest --device-mib 400
	$(PY) benchmarks/context_parallel.py --at 4096 --repeats 2
	$(PY) benchmarks/auto_layout.py --estimate
	$(PY) benchmarks/auto_layout.py --contest --repeats 3 --timed 10
	$(PY) benchmarks/load_pretrained.py --size large --repeats 3
	$(PY) benchmarks/save.py --sizes small medium large --async-size large --repeats 3
	$(PY) benchmarks/integrity.py --sizes 1.1 1.5 --repeats 5
	$(PY) benchmarks/memory.py --size large --steps 4
	$(PY) benchmarks/report.py

# On a machine with a CUDA GPU and a CUDA build of torch (not the CPU pins above), with that machine's python3 and its
# packages as they are: the tests marked `cuda` and a short single-GPU benchmark (benchmarks/results/gpu-*).
GPU_PYTHON ?= python3
gpu-check:
	PYTHONPATH=src:. $(GPU_PYTHON) -m pytest -q -m cuda tests/test_cuda.py
	PYTHONPATH=src:. $(GPU_PYTHON) benchmarks/gpu.py --repeats 1

clean:
	rm -rf $(VENV) outputs lightning_logs .pytest_cache
