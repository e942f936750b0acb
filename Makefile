# `make test` is what CI runs (.ci/run) on a fresh clone: it installs what the checks need
# (rustfmt, clippy, redis-server, PostgreSQL, PgBouncer, chromium, python3),
# then checks the module graph of src/ (no import cycle, the layers), runs fmt --check,
# clippy -D warnings, the whole test suite, and the smoke modes of the benches and examples.
# Benchmarks proper are `make bench`; they never run in `make test`.

CARGO ?= cargo
# Proptest cases: each property test sets its own (the wheel model test 10 000). PROPTEST_CASES
# is not exported: proptest lets it override every test's own count, which ran the persistence
# model test 10 000 times instead of its 500 (two minutes of CI).

.PHONY: test deps layers fmt clippy readme unit docs package smoke bench load fuzz
# The steps run in order, also under `make -j`.
.NOTPARALLEL:

# apt-get needs root: through sudo for another user (non-interactive: a password prompt would
# hang CI, so it fails instead, and the message says what to install).
# `make test NO_INSTALL=1` installs nothing: a missing tool fails the step, naming it.
SUDO := $(shell [ "$$(id -u)" = 0 ] || echo sudo -n)
ifeq ($(NO_INSTALL),)
APT := $(SUDO) env DEBIAN_FRONTEND=noninteractive apt-get
else
APT := false
endif

test: deps layers fmt clippy readme unit docs package smoke

deps:
	@command -v $(CARGO) >/dev/null || { echo "cargo not found: install Rust from https://rustup.rs"; exit 1; }
	@$(CARGO) fmt --version >/dev/null 2>&1 || rustup component add rustfmt || { \
		echo "rustfmt missing and rustup could not add it: install rustfmt for your toolchain"; exit 1; }
	@$(CARGO) clippy --version >/dev/null 2>&1 || rustup component add clippy || { \
		echo "clippy missing and rustup could not add it: install clippy for your toolchain"; exit 1; }
	@command -v cc >/dev/null || { \
		echo "no C compiler (the linker, openssl-sys): installing gcc with apt-get"; \
		($(APT) update -qq && $(APT) install -y -qq gcc libc6-dev) || { \
			echo "could not install gcc: install a C toolchain and re-run"; exit 1; }; }
	@# The Redis tests start their own redis-server from PATH (on a Unix socket in a temp dir).
	@# The TLS test makes a certificate with openssl; the `tls` feature builds against OpenSSL.
	@{ command -v openssl >/dev/null && pkg-config --exists openssl 2>/dev/null; } || { \
		echo "openssl or its headers missing: installing them with apt-get"; \
		($(APT) update -qq && $(APT) install -y -qq openssl libssl-dev pkg-config) || { \
			echo "could not install OpenSSL: install openssl, libssl-dev and pkg-config and re-run"; exit 1; }; }
	@{ command -v redis-server >/dev/null && command -v redis-cli >/dev/null; } || { \
		echo "redis-server or redis-cli missing: installing them with apt-get"; \
		($(APT) update -qq && $(APT) install -y -qq redis-server redis-tools) || { \
			echo "could not install redis-server: install it (e.g. apt-get install redis-server) and re-run"; exit 1; }; }
	@# Dedup's SET NX GET and the tests' CLIENT PAUSE ... ALL need Redis 7.0 or later.
	@v=$$(redis-server --version | sed -n 's/.* v=\([0-9]*\)\..*/\1/p'); \
		[ "$${v:-0}" -ge 7 ] || { echo "redis-server $$(redis-server --version | sed -n 's/.* v=\([^ ]*\).*/\1/p') is too old: the tests need 7.0 or later"; exit 1; }
	@# The dashboard test loads the page in a headless browser: Debian's chromium.
	@{ command -v chromium >/dev/null || command -v chromium-browser >/dev/null || [ -n "$$CHROMIUM" ]; } || { \
		echo "chromium missing (the dashboard test's headless browser): installing it with apt-get"; \
		($(APT) update -qq && $(APT) install -y -qq chromium) || { \
			echo "could not install chromium: install it (e.g. apt-get install chromium), or set CHROMIUM to a Chromium binary, and re-run"; exit 1; }; }
	@# The PostgreSQL tests start their own server (initdb into a temp dir; as an unprivileged
	@# user when run as root). Debian keeps initdb under /usr/lib/postgresql/<version>/bin.
	@{ ls /usr/lib/postgresql/*/bin/initdb >/dev/null 2>&1 || command -v initdb >/dev/null || [ -n "$$PG_BIN" ]; } || { \
		echo "PostgreSQL's server (initdb) missing: installing it with apt-get"; \
		($(APT) update -qq && $(APT) install -y -qq postgresql) || { \
			echo "could not install PostgreSQL: install it (e.g. apt-get install postgresql), or set PG_BIN to the directory of its initdb, and re-run"; exit 1; }; }
	@# One PostgreSQL test runs the store behind a private PgBouncer in transaction mode.
	@{ command -v pgbouncer >/dev/null || [ -x /usr/sbin/pgbouncer ]; } || { \
		echo "pgbouncer missing: installing it with apt-get"; \
		($(APT) update -qq && $(APT) install -y -qq pgbouncer) || { \
			echo "could not install pgbouncer: install it (e.g. apt-get install pgbouncer) and re-run"; exit 1; }; }
	@# The module graph check (.ci/layers.py) is Python 3, standard library only.
	@command -v python3 >/dev/null || { \
		echo "python3 missing: installing it with apt-get"; \
		($(APT) update -qq && $(APT) install -y -qq python3) || { \
			echo "could not install python3: install it and re-run"; exit 1; }; }

# No import cycle between the files of src/, and no layer importing from one above it (the
# rules are the table at the top of the script). Its self-test first: a check that passes
# because it sees nothing would be worse than none.
layers:
	python3 .ci/layers.py --self-test && python3 .ci/layers.py

fmt:
	$(CARGO) fmt --all -- --check

clippy:
	$(CARGO) clippy --all-targets --all-features -- -D warnings

# The README is the front door, read in five minutes: contracts go to rustdoc, past runs to
# benches/HISTORY.md.
README_LIMIT := 15000
readme:
	@size=$$(wc -c < README.md); [ $$size -le $(README_LIMIT) ] || { \
		echo "README.md is $$size bytes, over $(README_LIMIT): move details to rustdoc or benches/HISTORY.md"; exit 1; }

# The doc examples of the Redis layer run against one private redis-server (on a Unix socket in
# a temp dir, nothing on disk), named by DELAYWHEEL_TEST_REDIS; the integration tests start
# their own.
unit:
	@dir=$$(mktemp -d) && \
	redis-server --port 0 --unixsocket $$dir/redis.sock --save '' --appendonly no \
		--dir $$dir --pidfile $$dir/redis.pid --daemonize yes >/dev/null && \
	for i in $$(seq 100); do [ -S $$dir/redis.sock ] && break; sleep 0.05; done; \
	DELAYWHEEL_TEST_REDIS=redis+unix://$$dir/redis.sock $(CARGO) test --all-features; \
	status=$$?; kill $$(cat $$dir/redis.pid) 2>/dev/null; rm -rf $$dir; exit $$status
	@# Without the optional features, and with each alone: each gated module builds by itself.
	$(CARGO) clippy --no-default-features --all-targets -- -D warnings
	$(CARGO) clippy --lib --features futures -- -D warnings
	$(CARGO) clippy --lib --features redis -- -D warnings
	$(CARGO) clippy --lib --features periodic -- -D warnings
	$(CARGO) clippy --lib --features hyper,tower,otel -- -D warnings
	$(CARGO) clippy --lib --features postgres -- -D warnings

# No broken intra-doc link (docs.rs shows every feature), and the fuzz crate still builds.
docs:
	RUSTDOCFLAGS="-D warnings" $(CARGO) doc --all-features --no-deps
	cd fuzz && $(CARGO) check --locked

# The crate as it would be published: the packaged files build, with no warning from cargo.
package:
	@out=$$($(CARGO) publish --dry-run --all-features --allow-dirty --locked 2>&1); status=$$?; \
		echo "$$out" | tail -n 5; \
		[ $$status = 0 ] || { echo "$$out"; exit $$status; }; \
		! echo "$$out" | grep '^warning' | grep -vq 'aborting upload due to dry run' || { \
			echo "$$out" | grep '^warning'; echo "cargo publish --dry-run warned"; exit 1; }

# Every bench runs once on a small workload, and every example in its smoke mode, so they cannot rot.
smoke:
	$(CARGO) test --all-features --benches
	$(CARGO) run --all-features --example wheel_load -- --smoke --json
	@# Through a temp file, not a pipe (which would hide the example's exit status), and
	@# not under target/: CARGO_TARGET_DIR may put the build elsewhere.
	@out=$$(mktemp); $(CARGO) run --all-features --example gateway -- --smoke --json > $$out; \
		status=$$?; cat $$out; [ $$status = 0 ] || { rm -f $$out; exit $$status; }; \
		last=$$(tail -n 1 $$out); rm -f $$out; \
		for k in scheduled cancelled fired lost lateness_p50_ms lateness_p99_ms lateness_max_ms \
			bytes_per_timer idle_cpu_pct; do \
			echo "$$last" | grep -q "\"$$k\":" || { echo "gateway --json lacks \"$$k\""; exit 1; }; \
		done; \
		echo "$$last" | grep -q '"lost":0[,}]' || { echo "gateway --json reports lost timers"; exit 1; }
	$(CARGO) run --all-features --example persist_report -- --smoke --json
	$(CARGO) run --all-features --example pg_report -- --smoke --json
	$(CARGO) run --all-features --example pg_orders -- --smoke --json
	$(CARGO) run --all-features --example order_timeout -- --smoke --json
	$(CARGO) run --all-features --example vs_polling -- --smoke --json
	$(CARGO) run --all-features --example queue_load -- --smoke --json --producer single,batch
	$(CARGO) run --all-features --example queue_load -- --smoke --json --backlog 2000
	$(CARGO) run --all-features --example queue_load -- --smoke --json --designs delaywheel --limit-factors 2,0.5
	@# The minimal examples a user copies.
	$(CARGO) run --all-features --example timeouts
	$(CARGO) run --all-features --example durable_orders
	$(CARGO) run --all-features --example queue
	@# The three programs of a new user: a tokio gateway, an order service, a queue pair.
	$(CARGO) run --all-features --example tokio_gateway -- --smoke --json
	@# Every metric served to Prometheus on loopback, scraped once.
	$(CARGO) run --all-features --example prometheus
	@# A hyper + tower gateway on each timer, a child process putting the load on it.
	$(CARGO) run --all-features --example http_gateway -- --smoke --json
	$(CARGO) run --all-features --example order_service -- --smoke --json
	$(CARGO) run --all-features --example queue_pair -- --smoke --json

bench:
	$(CARGO) bench --bench wheel
	$(CARGO) bench --features futures --bench engine

load:
	$(CARGO) run --release --example gateway

# Needs cargo-fuzz (cargo install cargo-fuzz); RUSTC_BOOTSTRAP lets it use sanitizers on stable.
fuzz:
	cd fuzz && RUSTC_BOOTSTRAP=1 $(CARGO) fuzz run wheel_ops -- -max_total_time=300
