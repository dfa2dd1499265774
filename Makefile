# The two set-up commands of the README. Both start from a fresh clone: infra/bootstrap.sh makes .venv.
.PHONY: up test test-long down status
up:
	bash infra/bootstrap.sh
	.venv/bin/ropewalk up

test:
	bash infra/bootstrap.sh --for-tests
	.venv/bin/ruff check .  # the rules in pyproject.toml ([tool.ruff])
	.venv/bin/mypy  # the pure decision modules ([tool.mypy] in pyproject.toml)
	.venv/bin/python -m pytest -q -n 3 --dist loadfile --no-loadscope-reorder  # 3 workers, each with its own broker and Redis; files in tests/conftest.py's order

test-long:  # the long runs CI leaves out (pytest -m long): each has a brief version in `make test`
	bash infra/bootstrap.sh --for-tests
	.venv/bin/python -m pytest -q -m long

down:
	.venv/bin/ropewalk down

status:
	.venv/bin/ropewalk status
