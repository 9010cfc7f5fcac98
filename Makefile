# The two commands of the README: `make demo` and `make test`. Both bootstrap what they need.
VENV ?= .venv
PYTEST_ARGS ?=
# Two pytest workers, a test file each at a time: the suite mostly waits on its servers and child
# processes, so two halve the wall time on two cores. PYTEST_WORKERS=0 runs it in one process.
PYTEST_WORKERS ?= 2
DEMO_ARGS ?=

.PHONY: bootstrap test demo lint

bootstrap:
	@VENV=$(VENV) bash scripts/bootstrap.sh

# The tests also need the offline infra gate's tools (.venv-infra); the suite starts its own servers
# where the machine's cannot serve a test (see README, "Tests").
test:
	@VENV=$(VENV) bash scripts/bootstrap.sh --infra-gate
	$(VENV)/bin/python -m pytest -n $(PYTEST_WORKERS) --dist loadfile $(PYTEST_ARGS)

demo: bootstrap
	$(VENV)/bin/dbfanout demo $(DEMO_ARGS)

lint: bootstrap
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .
	$(VENV)/bin/mypy .
