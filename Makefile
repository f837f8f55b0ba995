# The two commands of the README, and the routine ones.
PY := .venv/bin/python
.PHONY: demo test setup setup-test lint proto bench images

demo: setup            ## install what is missing, then run collector + agent on this machine
	.venv/bin/fleetprof demo

test: setup-test       ## install what is missing (incl. test tools), then run the whole suite
	$(PY) -m pytest -q

setup:
	bash scripts/setup.sh

setup-test:
	bash scripts/setup.sh --test

lint:
	.venv/bin/ruff check . && .venv/bin/ruff format --check .

proto:                 ## regenerate fleetprof/_proto from proto/
	bash scripts/gen_proto.sh

bench: setup-test      ## agent overhead vs perf and bcc profile (see bench/)
	$(PY) bench/overhead.py

images:                ## podman builds of deploy/Dockerfile.{agent,collector} for linux/amd64 and linux/arm64
	bash scripts/images.sh amd64 arm64
