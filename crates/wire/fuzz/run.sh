#!/usr/bin/env bash
# Runs every fuzz target of nodedns-wire for SECONDS each (default 20) and exits non-zero if any
# target finds a crash (the reproducer is left in artifacts/<target>/).
#
#   crates/wire/fuzz/run.sh [SECONDS]
#
# Needs cargo-fuzz (installed here if missing) and a C++ compiler for libFuzzer. cargo-fuzz passes
# nightly-only flags (-Zsanitizer=address, sancov); RUSTC_BOOTSTRAP=1 lets a stable toolchain
# accept them, so no nightly is needed.
set -euo pipefail

seconds="${1:-20}"
cd "$(dirname "$0")"

if ! command -v cargo-fuzz >/dev/null 2>&1; then
    cargo install cargo-fuzz --locked
fi
export RUSTC_BOOTSTRAP=1

failed=()
for target in $(cargo fuzz list); do
    mkdir -p "corpus/$target"
    echo "== fuzzing $target for ${seconds}s"
    # New inputs go to corpus/ (not committed); the committed seeds/ and grown/ (what the
    # hour-long runs found, minimised) are only read.
    mkdir -p "grown/$target"
    if ! cargo fuzz run "$target" "corpus/$target" "seeds/$target" "grown/$target" -- \
        -max_total_time="$seconds" -timeout=10 -print_final_stats=1; then
        failed+=("$target")
    fi
done

if ((${#failed[@]})); then
    echo "fuzz: crash in ${failed[*]} (see crates/wire/fuzz/artifacts/)" >&2
    exit 1
fi
echo "fuzz: all targets ran ${seconds}s without a crash"
