# The two commands of the README, and the routine ones.
PY := .venv/bin/python
.PHONY: demo test setup setup-test lint proto bench images

demo: setup            ## install what is missing, then run collector + agent on this machine
	.venv/bin/fleetprof demo

# The whole suite, as two pytest runs side by side and one after (tests/conftest.py says which test goes where):
#   1. every test that loads no BPF program and needs nothing alone (most of the count), one pytest-xdist
#      worker per CPU, a file at a time (a module's fixtures are made once: split over both workers, the
#      arm64 guest booted twice, 819 s of CPU instead of ~400), the files with `slow` tests first, longest
#      first (tests/conftest.py; --no-loadscope-reorder: xdist would hand out the files with the most tests
#      first, and the guest started minutes late);
#   2. meanwhile, the tests that load BPF programs (`bpf`), two files at a time (FLEETPROF_TEST_PHASE=bpf),
#      `slow` files first. Each judges its samples against its own workload's clock (the CPU time it
#      measured of itself), finds its own samples by pid and sizes its tables for a busy node, so neither
#      phase 1 nor the other BPF file disturbs it. Most of their time is waiting (workloads that run for a
#      time, drains), but three at a time (with the ClickHouse cluster's file moved beside them) made the
#      suite slower, not faster (bench/README.md, "make test's time"). Their output is printed when both
#      are done (.venv/test-bpf.log);
#   3. the `serial` ones, alone (none at present; with none, pytest's 5, "no tests ran", is no failure).
# All run; it fails if any failed. The images that tests/deploy/test_images.py runs are built meanwhile, from
# the moment the Debian packages are in, so that a first build (it debootstraps and downloads for minutes;
# later ones are podman's cache) runs on the core the virtualenv's install (uv: ~4 s, pip ~25 s) leaves idle; scripts/images.sh
# holds a lock, so the test's own call waits for that build and reports a failed one itself: both
# architectures where the other one's base is there (`make images` made it once), else this one's.
# FLEETPROF_TEST_SHARED is a directory the runs share (tests/conftest.py shared_dir), removed at the end.
# Bytecode is written (into __pycache__, ignored by git) whatever PYTHONDONTWRITEBYTECODE says: this machine
# kind's environment sets it, and then each of the suite's Python processes (collectors, agents, CLIs,
# pytest's workers rewriting every test module's asserts) compiled every module it imported, again.
test:                  ## install what is missing (incl. test tools), then run the whole suite
	@bash scripts/setup.sh --test --system
	@unset PYTHONDONTWRITEBYTECODE; status=0; mkdir -p .venv; \
	bash scripts/images.sh $$(bash scripts/images.sh --cached-arches) >.venv/images-build.log 2>&1 & images=$$!; \
	bash scripts/setup.sh --test || { kill $$images; exit 1; }; \
	export FLEETPROF_TEST_SHARED="$$(mktemp -d /tmp/fleetprof-test.XXXXXX)"; \
	FLEETPROF_TEST_PHASE=bpf $(PY) -m pytest -q -m "bpf and not serial" -n 2 --dist loadfile --no-loadscope-reorder \
		--durations=12 \
		>.venv/test-bpf.log 2>&1 & bpf=$$!; \
	$(PY) -m pytest -q -m "not bpf and not serial" -n "$$(nproc)" --dist loadfile --no-loadscope-reorder --durations=12 || status=$$?; \
	wait $$bpf || status=$$?; \
	echo "== the BPF tests, run alongside (.venv/test-bpf.log):"; cat .venv/test-bpf.log; \
	wait $$images || true; \
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
