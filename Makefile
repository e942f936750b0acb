# `make test` is what CI runs (.ci/run) on a fresh clone: it installs what the checks need
# (rustfmt, clippy, redis-server),
# then runs fmt --check, clippy -D warnings, the whole test suite, and the smoke modes of the
# benches and examples. Benchmarks proper are `make bench`; they never run in `make test`.

CARGO ?= cargo
# Proptest cases for the wheel model test (the issue asks for at least 10 000 in CI).
PROPTEST_CASES ?= 10000
export PROPTEST_CASES

.PHONY: test deps fmt clippy unit smoke bench load fuzz

test: deps fmt clippy unit smoke

deps:
	@command -v $(CARGO) >/dev/null || { echo "cargo not found: install Rust from https://rustup.rs"; exit 1; }
	@$(CARGO) fmt --version >/dev/null 2>&1 || rustup component add rustfmt
	@$(CARGO) clippy --version >/dev/null 2>&1 || rustup component add clippy
	@# The Redis tests start their own redis-server from PATH (on a Unix socket in a temp dir).
	@# The TLS test makes a certificate with openssl; the `tls` feature builds against OpenSSL.
	@{ command -v openssl >/dev/null && pkg-config --exists openssl 2>/dev/null; } || { \
		echo "openssl or its headers missing: installing them with apt-get"; \
		(apt-get update -qq && apt-get install -y -qq openssl libssl-dev pkg-config) || { \
			echo "could not install OpenSSL: install openssl, libssl-dev and pkg-config and re-run"; exit 1; }; }
	@command -v redis-server >/dev/null || { \
		echo "redis-server missing: installing it with apt-get"; \
		(apt-get update -qq && apt-get install -y -qq redis-server) || { \
			echo "could not install redis-server: install it (e.g. apt-get install redis-server) and re-run"; exit 1; }; }
	@# Dedup's SET NX GET and the tests' CLIENT PAUSE ... ALL need Redis 7.0 or later.
	@v=$$(redis-server --version | sed -n 's/.* v=\([0-9]*\)\..*/\1/p'); \
		[ "$${v:-0}" -ge 7 ] || { echo "redis-server $$(redis-server --version | sed -n 's/.* v=\([^ ]*\).*/\1/p') is too old: the tests need 7.0 or later"; exit 1; }

fmt:
	$(CARGO) fmt --all -- --check

clippy:
	$(CARGO) clippy --all-targets --all-features -- -D warnings

unit:
	$(CARGO) test --all-features
	$(CARGO) build --no-default-features --all-targets

# Every bench runs once on a small workload, and every example in its smoke mode, so they cannot rot.
smoke:
	$(CARGO) test --all-features --benches
	$(CARGO) run --all-features --example wheel_load -- --smoke --json
	$(CARGO) run --all-features --example gateway -- --smoke --json
	$(CARGO) run --all-features --example persist_report -- --smoke --json
	$(CARGO) run --all-features --example order_timeout -- --smoke --json
	$(CARGO) run --all-features --example vs_polling -- --smoke --json

bench:
	$(CARGO) bench --bench wheel
	$(CARGO) bench --bench engine

load:
	$(CARGO) run --release --example gateway

# Needs cargo-fuzz (cargo install cargo-fuzz); RUSTC_BOOTSTRAP lets it use sanitizers on stable.
fuzz:
	cd fuzz && RUSTC_BOOTSTRAP=1 $(CARGO) fuzz run wheel_ops -- -max_total_time=300
