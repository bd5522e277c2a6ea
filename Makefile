# megarlhf: the two commands of the README (`make demo`, `make test`) and their helpers.
# Both set up .venv first if needed (tools/setup_env.sh is idempotent: a no-op once installed).
PY := .venv/bin/python
export OMP_NUM_THREADS ?= 2

.PHONY: setup demo preference-demo test test-slow bench

setup:
	bash tools/setup_env.sh

demo: setup
	$(PY) examples/demo.py

preference-demo: setup
	$(PY) examples/preference_demo.py

test: setup
	$(PY) -m pytest -q

test-slow: setup
	$(PY) -m pytest -q -m slow

bench: setup
	for b in bench/bench_*.py; do echo "== $$b"; $(PY) $$b || exit 1; done
