# The README's two commands. Each sets up .venv first (a few minutes the first time).
.PHONY: demo test test-fast setup

setup:
	@bash .ci/setup

demo: setup
	@.venv/bin/tandem demo

test: setup
	@.venv/bin/python -m pytest -q --durations=25

test-fast: setup
	@.venv/bin/python -m pytest -q -m "not slow"
