# The two commands of the README, and the routine ones.
PY := .venv/bin/python
.PHONY: demo test setup setup-test lint proto bench images

demo: setup            ## install what is missing, then run collector + agent on this machine
	.venv/bin/fleetprof demo

# The whole suite in three phases (tests/conftest.py says which test goes where):
#   1. every test that loads no BPF program and needs nothing alone (most of the count), one pytest-xdist
#      worker per CPU;
#   2. the tests that load BPF programs (`bpf`), one at a time. They were run side by side (a file per
#      worker): each judges its samples against its own workload's clock, but three fresh-clone runs each
#      failed a different one of them on what the neighbour did to the node (tables queued behind its
#      files, its threads filling the off-CPU table, its processes' syscalls), so they stay one at a time
#      until each holds beside a neighbour (FLEETPROF_TEST_PHASE=bpf lets them run under xdist to try);
#   3. the `serial` ones, alone (none today: pytest's 5, "no tests ran", is no failure).
# All phases always run; it fails if any failed. The images that tests/deploy/test_images.py runs are built
# meanwhile (a first build debootstraps and downloads for minutes; later ones are podman's cache) and
# finished before phase 2 starts; the test runs scripts/images.sh again and reports a failed build itself:
# both architectures where the other one's base is there (`make images` made it once), else this one's.
# FLEETPROF_TEST_SHARED is a directory the phases share (tests/conftest.py shared_dir), removed at the end.
test: setup-test       ## install what is missing (incl. test tools), then run the whole suite
	@status=0; \
	export FLEETPROF_TEST_SHARED="$$(mktemp -d /tmp/fleetprof-test.XXXXXX)"; \
	bash scripts/images.sh $$(bash scripts/images.sh --cached-arches) >.venv/images-build.log 2>&1 & images=$$!; \
	$(PY) -m pytest -q -m "not bpf and not serial" -n "$$(nproc)" || status=$$?; \
	wait $$images || true; \
	$(PY) -m pytest -q -m "bpf and not serial" || status=$$?; \
	$(PY) -m pytest -q -m serial || { rc=$$?; [ $$rc -eq 5 ] || status=$$rc; }; \
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
