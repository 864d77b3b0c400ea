# The two commands of the README are `make run` and `make test`; both set up first (idempotent).
.PHONY: setup run test test-fast lint format repro

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

# The DVC pipeline (dvc.yaml); its stages call `arpo stage NAME`, so the venv's bin goes first on PATH.
# `arpo lock` first: beside a live run it names the run (DVC itself would refuse too, in its own words).
repro: setup
	@.venv/bin/arpo lock >/dev/null && PATH="$(CURDIR)/.venv/bin:$$PATH" DVC_NO_ANALYTICS=1 .venv/bin/dvc repro
