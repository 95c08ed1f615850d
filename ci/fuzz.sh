#!/usr/bin/env bash
# Runs every cargo-fuzz target of nodedns briefly (SECONDS each, default 20), starting from the
# committed seed corpus, and fails if any target finds a crash (the reproducer is left in
# <project>/artifacts/<target>/). The projects: crates/wire/fuzz (query parser, reply parser and
# patcher with its TTL index, frame splitting, and all of them against hickory-proto's decoder)
# and crates/agent/fuzz (Corefile and kube-dns ConfigMap parser, the TCP listener's framing with
# the pipeline behind it). docs/reliability.md says how the hour-long runs that grew the seeds
# were made.
#
#   ci/fuzz.sh [SECONDS]    # build, then run the targets, one per CPU at a time
#   ci/fuzz.sh --build      # build every target only
#
# Needs cargo-fuzz (installed if missing) and a C++ compiler for libFuzzer. cargo-fuzz passes
# nightly-only flags (sancov); RUSTC_BOOTSTRAP=1 lets the stable toolchain accept them.
#
# These brief runs build without AddressSanitizer (`--sanitizer none`): the workspace denies
# `unsafe`, and its one exception (serve/udp.rs) is not reached by any target, so ASan would
# watch only the dependencies and std, at two fifths more build time (the agent's project: 5 min
# 38 s against 4 min 2 s). A crash is still a panic, an abort, a time-out or the RSS limit.
set -euo pipefail

build_only=0
seconds=20
case "${1:-}" in
    --build) build_only=1 ;;
    '') ;;
    *[!0-9]* | 0) echo "ci/fuzz.sh: SECONDS must be a positive whole number, or --build: $1" >&2; exit 64 ;;
    *) seconds="$1" ;;
esac
cd "$(dirname "$0")/.."
root="$PWD"
projects=(crates/wire/fuzz crates/agent/fuzz)

if ! command -v cargo-fuzz >/dev/null 2>&1; then
    cargo install cargo-fuzz --locked
fi
export RUSTC_BOOTSTRAP=1

for project in "${projects[@]}"; do
    echo "== building $project"
    (cd "$root/$project" && cargo fuzz build --sanitizer none)
done
if [ "$build_only" = 1 ]; then
    exit 0
fi

# A target's output goes to its own log, printed once every target has run; a crash is recorded
# in failed.
logs="$(mktemp -d)"
trap 'rm -rf "$logs"' EXIT
run() {
    local project="$1" target="$2" log="$3"
    cd "$root/$project"
    # New inputs go to corpus/ (not committed); the committed seeds/ and grown/ (what the
    # hour-long runs found, minimised) are only read.
    mkdir -p "corpus/$target" "grown/$target"
    if ! cargo fuzz run --sanitizer none "$target" "corpus/$target" "seeds/$target" "grown/$target" -- \
        -max_total_time="$seconds" -timeout=10 -rss_limit_mb=4096 -print_final_stats=1 \
        >"$log" 2>&1; then
        echo "$project/$target" >>"$logs/failed"
    fi
}

at_once="$(nproc)"
echo "== fuzzing every target for ${seconds}s, $at_once at a time"
order=()
for project in "${projects[@]}"; do
    for target in $(cd "$root/$project" && cargo fuzz list); do
        while [ "$(jobs -rp | wc -l)" -ge "$at_once" ]; do wait -n || true; done
        name="${project//\//_}.$target"
        order+=("$name")
        run "$project" "$target" "$logs/$name.log" &
    done
done
wait
for name in "${order[@]}"; do
    echo "== $name"
    cat "$logs/$name.log"
done

if [ -s "$logs/failed" ]; then
    echo "fuzz: crash in $(tr '\n' ' ' <"$logs/failed")(see <project>/artifacts/<target>/)" >&2
    exit 1
fi
echo "fuzz: every target ran ${seconds}s without a crash"
