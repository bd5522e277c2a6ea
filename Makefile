# megarlhf: the two commands of the README (`make demo`, `make test`) and their helpers.
# Both set up .venv first if needed (tools/setup_env.sh is idempotent: a no-op once installed).
PY := .venv/bin/python
export OMP_NUM_THREADS ?= 2

.PHONY: setup setup-openenv demo preference-demo test test-slow bench

setup:
	bash tools/setup_env.sh

# the environment OpenEnv servers run from (tests/envs/test_openenv.py, examples/openenv): not megarlhf's own
setup-openenv:
	bash tools/setup_openenv.sh

demo: setup
	$(PY) examples/demo.py

preference-demo: setup
	$(PY) examples/preference_demo.py

# One thread per process: most tests run 2-rank torchrun jobs on the 2 cores, which two threads each
# oversubscribe (the default suite took 27 min with 2 threads, 21 min with 1).
# Two pytest workers (pytest-xdist): one test's ranks wait on each other (collectives, a rank-0 write,
# process start-up), and the other worker's test fills those gaps. On the 2-core machine the default
# suite took 13:25 with one worker and 10:36 with two (CPU busy 191%); 8:40 since Megatron's import stopped
# building torch.compile wrappers on CPU (parallel/cpu_compat.py, patch 8). TEST_WORKERS=0 runs in-process.
TEST_WORKERS ?= 2
XDIST := $(if $(filter 0,$(TEST_WORKERS)),,-n $(TEST_WORKERS) --dist worksteal)

test: setup setup-openenv
	OMP_NUM_THREADS=1 $(PY) -m pytest -q $(XDIST)

test-slow: setup setup-openenv
	OMP_NUM_THREADS=1 $(PY) -m pytest -q -m slow $(XDIST)

bench: setup
	for b in bench/bench_*.py; do echo "== $$b"; $(PY) $$b || exit 1; done
