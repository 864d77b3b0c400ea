# The two commands of the README are `make run` and `make test`; both set up first (idempotent).
.PHONY: setup run test test-fast lint format

setup:
	@bash scripts/setup.sh

run: setup
	@.venv/bin/arpo run

test: setup
	@bash scripts/test.sh

# Skip the tests marked slow (real training runs, many browser episodes): for the edit-test loop.
test-fast: setup
	@bash scripts/test.sh -m "not slow and not gpu"

lint: setup
	@.venv/bin/ruff check . && .venv/bin/ruff format --check .

format: setup
	@.venv/bin/ruff format . && .venv/bin/ruff check --fix .
