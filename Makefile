# The two commands of the README, and the routine ones.
PY := .venv/bin/python
.PHONY: demo test setup setup-test lint proto bench images

demo: setup            ## install what is missing, then run collector + agent on this machine
	.venv/bin/fleetprof demo

# The whole suite in two phases (tests/conftest.py): the tests that may run side by side on one worker per
# CPU, then the serial ones alone. Both phases always run; it fails if either failed. The images that
# tests/test_images.py runs are built meanwhile (a first build debootstraps and downloads for minutes;
# later ones are podman's cache) and finished before the serial phase starts, so nothing runs beside it;
# the test runs scripts/images.sh again and reports a failed build itself. FLEETPROF_TEST_SHARED is a
# directory the two phases share (tests/conftest.py shared_dir), removed at the end.
test: setup-test       ## install what is missing (incl. test tools), then run the whole suite
	@status=0; \
	export FLEETPROF_TEST_SHARED="$$(mktemp -d /tmp/fleetprof-test.XXXXXX)"; \
	bash scripts/images.sh >.venv/images-build.log 2>&1 & images=$$!; \
	$(PY) -m pytest -q -m "not serial" -n "$$(nproc)" || status=$$?; \
	wait $$images || true; \
	$(PY) -m pytest -q -m serial || status=$$?; \
	rm -rf "$$FLEETPROF_TEST_SHARED"; \
	exit $$status

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
