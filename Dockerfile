# syntax=docker/dockerfile:1.7
#
# The nodedns image: the statically linked `nodedns` binary, the rule tools it runs (`nft`, and
# iptables in its nft and legacy variants, as kube-proxy's image carries them) with exactly the
# shared libraries and extension modules those tools load, Debian's CA bundle (what a
# `forward . tls://` trusts when no CA file is named), and what manifests written for
# node-cache's image run besides node-cache: the path `/node-cache`, a POSIX shell (`sh`,
# `/bin/sh`) and `sleep`. Nothing else: no package manager, no library that nothing calls, so a
# scanner has little to report (compare kubernetes/dns#754).
#
#   docker build -t nodedns:dev .
#   docker buildx build --platform linux/amd64,linux/arm64 -t REGISTRY/nodedns:TAG --push .
#
# Each platform builds natively (under emulation in buildx): the Rust target is picked from the
# build machine's architecture.

ARG RUST_VERSION=1.95
ARG DEBIAN_RELEASE=bookworm

# 1. nodedns, linked statically (static-pie against glibc): no dynamic loader, no shared library.
#    glibc rather than musl for its string functions (memcpy and memcmp, vectorized, on the hit
#    path); the allocator is jemalloc, built in. nodedns resolves no names at run time, so static
#    glibc's NSS caveat does not bite.
FROM rust:${RUST_VERSION}-${DEBIAN_RELEASE} AS build
SHELL ["/bin/bash", "-o", "pipefail", "-c"]
WORKDIR /src
COPY . .
# --target keeps the static flag off build scripts and proc macros, which the host runs.
RUN --mount=type=cache,target=/usr/local/cargo/registry \
    --mount=type=cache,target=/src/target \
    target="$(uname -m)-unknown-linux-gnu" \
 && RUSTFLAGS="-C target-feature=+crt-static" \
    cargo build --locked --release --package nodedns-agent --bin nodedns --target "$target" \
 && install -D -m 0755 "target/$target/release/nodedns" /out/usr/bin/nodedns \
 && strip --strip-debug /out/usr/bin/nodedns \
 && if readelf --program-headers /out/usr/bin/nodedns | grep -q INTERP \
      || readelf --dynamic /out/usr/bin/nodedns | grep -q NEEDED; then \
      echo "nodedns is not statically linked" >&2; exit 1; \
    fi

# 2. nft and iptables from Debian, and the files they need, gathered under /rootfs.
FROM debian:${DEBIAN_RELEASE}-slim AS tools
SHELL ["/bin/bash", "-o", "pipefail", "-c"]
# Unpinned on purpose: the security updates of the release are what this image should carry.
# hadolint ignore=DL3008
RUN apt-get update \
 && apt-get install -y --no-install-recommends nftables iptables ca-certificates \
 && rm -rf /var/lib/apt/lists/*
# (From /: coreutils 9.1's `cp -a --parents` mishandles absolute sources from elsewhere.)
WORKDIR /
RUN <<'EOF'
set -euo pipefail
root=/rootfs
mkdir -p "$root"
copy() { cp -a --parents "$@" "$root"/; }

# What nodedns runs: `nft`, and `{ip,ip6}tables-{nft,legacy}{,-save,-restore}`, which Debian
# ships as links to two multi-call binaries (each looks at the name it was run by).
copy /usr/sbin/nft /usr/sbin/xtables-nft-multi /usr/sbin/xtables-legacy-multi
for family in iptables ip6tables; do
  for variant in nft legacy; do
    copy "/usr/sbin/$family-$variant" "/usr/sbin/$family-$variant-save" "/usr/sbin/$family-$variant-restore"
  done
done
# iptables loads its matches and targets (udp, comment, NOTRACK, CT, ...) with dlopen, so no
# dependency list names them: take the directory whole.
xtables="$(echo /usr/lib/*-linux-gnu/xtables)"
copy "$xtables"

# Every shared library those programs and modules load, and the dynamic loader, found by ldd
# and copied under the name they are looked up by.
{
  for f in /usr/sbin/nft /usr/sbin/xtables-nft-multi /usr/sbin/xtables-legacy-multi "$xtables"/*.so \
      /usr/bin/dash /usr/bin/sleep; do
    ldd "$f"
  done
} | awk '$2 == "=>" && $3 ~ /^\// { print $3 } $1 ~ /^\// { print $1 }' | sort -u \
  | while read -r lib; do cp -L --parents "$lib" "$root"/; done

# Manifests written for node-cache's image run, besides `/node-cache ARGS`, KubeOne's
# `/bin/sh -c "sleep 10; exec /node-cache ..."` and kubespray's preStop `sh -c "sleep N && kill -9
# 1"`: a shell with `exec` and `kill` built in, and `sleep`. Debian's dash and coreutils' sleep,
# both linked against nothing but the glibc already here for nft and iptables: 170 KB, two
# programs of packages every Debian system carries. Not busybox: one binary with some 300
# programs (wget, nc, httpd, ...), which scanners identify by its version string and report
# with all its CVEs. No other coreutils: nothing those manifests run needs them.
copy /usr/bin/dash /usr/bin/sleep
ln -s dash "$root/usr/bin/sh"
ln -s usr/bin "$root/bin"
# node-cache's path, to the binary the last stage copies in (a dangling link until then).
ln -s usr/bin/nodedns "$root/node-cache"

# nft prints protocol names (`meta l4proto udp`) from /etc/protocols.
copy /etc/protocols
# The system's CAs for tls:// upstreams, at the first path Go (CoreDNS) and nodedns look at.
copy /etc/ssl/certs/ca-certificates.crt
# The dynamic loader's cache, for the libraries above only.
mkdir -p "$root/etc"
cp /etc/ld.so.conf "$root/etc/"
cp -a /etc/ld.so.conf.d "$root/etc/"
ldconfig -r "$root"

# Directories the pod spec and the stock nodelocaldns.yaml expect: /tmp for its
# `-pidfile /tmp/node-cache.pid`, /etc for its `-conf /etc/Corefile`, /run for the xtables lock.
mkdir -p "$root/tmp" "$root/run" "$root/etc/coredns"
chmod 1777 "$root/tmp"

# Check the copy: each tool runs from the new root, with nothing but what was gathered.
chroot "$root" /usr/sbin/nft --version
for tool in iptables-nft iptables-legacy ip6tables-nft-restore ip6tables-legacy-save; do
  chroot "$root" "/usr/sbin/$tool" --version
done
chroot "$root" /bin/sh -c 'sleep 0 && kill -0 $$ && exec sh -c "exit 0"'
EOF

# 3. The image.
FROM scratch
COPY --from=tools /rootfs/ /
COPY --from=build /out/ /
ENV PATH=/usr/bin:/usr/sbin
# Runs as root by default, with the capabilities the pod spec grants (NET_ADMIN and
# NET_BIND_SERVICE in manifests/, everything else dropped): nft and iptables need CAP_NET_ADMIN
# in their own effective set, which only uid 0 passes on across exec without ambient
# capabilities. It also lets the image drop into an existing nodelocaldns.yaml unchanged. The
# cilium manifests, which need no capability, set runAsUser 65532.
ENTRYPOINT ["/usr/bin/nodedns"]
