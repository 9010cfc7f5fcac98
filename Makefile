# The two commands of the README: `make demo` and `make test`. Both bootstrap what they need.
VENV ?= .venv
PYTEST_ARGS ?=
DEMO_ARGS ?=

.PHONY: bootstrap test demo lint

bootstrap:
	@VENV=$(VENV) bash scripts/bootstrap.sh

test: bootstrap
	$(VENV)/bin/python -m pytest $(PYTEST_ARGS)

demo: bootstrap
	$(VENV)/bin/dbfanout demo $(DEMO_ARGS)

lint: bootstrap
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .
	$(VENV)/bin/mypy .
