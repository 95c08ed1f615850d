#!/usr/bin/env bash
# Runs every cargo-fuzz target of nodedns briefly (SECONDS each, default 20), starting from the
# committed seed corpus, and fails if any target finds a crash (the reproducer is left in
# <project>/artifacts/<target>/). The projects: crates/wire/fuzz (query parser, reply parser and
# patcher with its TTL index, frame splitting, and all of them against hickory-proto's decoder)
# and crates/agent/fuzz (Corefile and kube-dns ConfigMap parser, the TCP listener's framing with
# the pipeline behind it). docs/reliability.md says how the hour-long runs that grew the seeds
# were made.
#
#   ci/fuzz.sh [SECONDS]
#
# Needs cargo-fuzz (installed if missing) and a C++ compiler for libFuzzer. cargo-fuzz passes
# nightly-only flags (-Zsanitizer=address, sancov); RUSTC_BOOTSTRAP=1 lets the stable toolchain
# accept them.
set -euo pipefail

seconds="${1:-20}"
cd "$(dirname "$0")/.."
root="$PWD"

if ! command -v cargo-fuzz >/dev/null 2>&1; then
    cargo install cargo-fuzz --locked
fi
export RUSTC_BOOTSTRAP=1

failed=()
for project in crates/wire/fuzz crates/agent/fuzz; do
    cd "$root/$project"
    for target in $(cargo fuzz list); do
        mkdir -p "corpus/$target"
        echo "== fuzzing $project $target for ${seconds}s"
        # New inputs go to corpus/ (not committed); the committed seeds/ and grown/ (what the
        # hour-long runs found, minimised) are only read.
        mkdir -p "grown/$target"
        if ! cargo fuzz run "$target" "corpus/$target" "seeds/$target" "grown/$target" -- \
            -max_total_time="$seconds" -timeout=10 -rss_limit_mb=4096 -print_final_stats=1; then
            failed+=("$project/$target")
        fi
    done
done

if ((${#failed[@]})); then
    echo "fuzz: crash in ${failed[*]} (see <project>/artifacts/<target>/)" >&2
    exit 1
fi
echo "fuzz: every target ran ${seconds}s without a crash"
