#!/usr/bin/env bash
# CI for the image, on a machine without a container engine: assembles the image's file tree the
# way the Dockerfile does, from the Dockerfile's own commands, and runs it.
#
#   sudo ci/image.sh            # root (chroot, network namespaces); needs cargo, nftables,
#                               # iptables and iproute2 installed, as .ci/run installs them
#
# 1. Stage `build`: the Dockerfile's RUN, with /out moved into a scratch folder (the cache mounts
#    are a build-speed detail and are dropped): a static-pie nodedns, checked to have no
#    interpreter and no shared library.
# 2. Stage `tools`: the Dockerfile's heredoc script, /rootfs moved into the scratch folder, run
#    against this machine's Debian packages (the apt-get step is the machine's: .ci/run). It
#    already checks each tool runs from the new root.
# 3. The `scratch` image: both trees copied over each other, as the two COPY lines do. Then, with
#    the tree as the root of every process (chroot) and a network namespace of its own, as a pod
#    with hostNetwork would see its node: `nodedns --version`, a `forward . tls://` Corefile
#    checked (it loads the image's CA bundle), and `nodedns run` setting up its
#    link, addresses and rules with the image's `nft`, then its `iptables-restore` (nft and
#    legacy), each checked from outside with the host's tools, answering `dig` on the link's
#    address, and tearing down on SIGTERM.
# 4. As manifests written for node-cache's image run it, in a PID namespace of its own as a
#    container has: KubeOne's `/bin/sh -c "sleep 10; exec /node-cache -localip ... -conf
#    /etc/Corefile -upstreamsvc kube-dns-upstream"` (with its Corefile.base mounted), which
#    becomes PID 1; then kubespray's preStop `sh -c "sleep N && kill -9 1"`, run inside the
#    container's namespaces and root as the kubelet runs an exec hook: it exits 0 and the agent
#    still answers (a PID namespace's init ignores SIGKILL from inside it); then the runtime's
#    SIGTERM from outside, and teardown.
#
# Prints the size of the tree. What it cannot show: that a registry accepts the image, and the
# arm64 build.
set -euo pipefail
cd "$(dirname "$0")/.."

if [ "$(id -u)" != 0 ]; then
  echo "ci/image.sh: needs root (chroot, network namespaces)" >&2
  exit 1
fi
for tool in cargo nft iptables ip readelf chroot unshare nsenter dig; do
  command -v "$tool" >/dev/null || { echo "ci/image.sh: $tool is not installed" >&2; exit 1; }
done

work=$(mktemp -d /tmp/nodedns-image.XXXXXX)
ns=nodedns-image-$$
agent=
cleanup() {
  [ -n "$agent" ] && kill "$agent" 2>/dev/null && wait "$agent" 2>/dev/null
  ip netns del "$ns" 2>/dev/null || true
  rm -rf "$work"
}
trap cleanup EXIT

# The shell of the RUN instruction that follows the line matching $1 in the Dockerfile: its
# continuation lines joined, BuildKit's `--mount=` options dropped.
run_after() {
  awk -v start="$1" '
    found && /^RUN / { running = 1; sub(/^RUN /, "") }
    running {
      line = $0; cont = sub(/\\$/, "", line)
      gsub(/--mount=[^ ]+/, "", line)
      printf "%s ", line
      if (!cont) exit
    }
    $0 ~ start { found = 1 }
  ' Dockerfile
}

# The heredoc body of the RUN <<'EOF' instruction.
heredoc() {
  awk '/^RUN <<.EOF.$/ { inside = 1; next } inside && /^EOF$/ { exit } inside { print }' Dockerfile
}

echo "== stage build: static nodedns"
build=$(run_after '^FROM rust:')
[ -n "$build" ] || { echo "ci/image.sh: no RUN found in the build stage" >&2; exit 1; }
mkdir -p "$work/out"
# The Dockerfile builds in /src with /src/target as its cache; here the checkout and its target.
(set -x; bash -o pipefail -c "${build//\/out\//$work/out/}")
binary="$work/out/usr/bin/nodedns"
file_size=$(stat -c %s "$binary")

echo "== stage tools: nft and iptables with what they load"
script=$(heredoc)
grep -q '^root=/rootfs$' <<<"$script" || { echo "ci/image.sh: the tools script changed shape" >&2; exit 1; }
(cd / && bash -c "${script/root=\/rootfs/root=$work/rootfs}")

echo "== the image"
root="$work/rootfs"
cp -a "$work/out/." "$root/"
# Mount points, made by the runtime in a pod.
mkdir -p "$root/proc" "$root/dev" "$root/sys"
touch "$root/etc/resolv.conf"
echo "nameserver 192.0.2.53" >"$work/resolv.conf"
printf 'image tree: %s (nodedns %s bytes), %s files\n' \
  "$(du -sh "$root" | cut -f1)" "$file_size" "$(find "$root" -type f | wc -l)"
chroot "$root" /usr/bin/nodedns --version
# A tls:// forward that names no CA file loads the system's CAs: the image's bundle.
printf '.:53 {\n    forward . tls://192.0.2.53 {\n        tls_servername dns.example\n    }\n}\n' \
  >"$root/tmp/Corefile.tls"
chroot "$root" /usr/bin/nodedns run --check-config --conf /tmp/Corefile.tls \
  --resolv-conf /etc/resolv.conf >/dev/null
rm "$root/tmp/Corefile.tls"

ip netns add "$ns"
ip -n "$ns" link set lo up
local_ip=169.254.20.10
# Runs the image's nodedns in the namespace with the given rules backend; waits for its rules.
start() {
  local log="$work/nodedns-$1.log"
  # What a container runtime mounts: /proc, /dev, the namespace's /sys, and the node's
  # resolv.conf (dnsPolicy: Default; here a documentation address nobody asks), in a mount
  # namespace of the agent's own, so they go away with it.
  ip netns exec "$ns" unshare --mount sh -c '
    root=$1; resolv=$2; shift 2
    mount -t proc proc "$root/proc" && mount --rbind /dev "$root/dev" &&
      mount -t sysfs sysfs "$root/sys" && mount --bind "$resolv" "$root/etc/resolv.conf" &&
      exec chroot "$root" "$@"' sh "$root" "$work/resolv.conf" \
    /usr/bin/nodedns run --local-ip "$local_ip" --link-kind bridge --rules-backend "$1" \
    --upstream 127.0.0.1:5399 >"$log" 2>&1 &
  agent=$!
  for _ in $(seq 100); do
    grep -q "serving DNS" "$log" && return 0
    kill -0 "$agent" 2>/dev/null || break
    sleep 0.1
  done
  cat "$log" >&2
  echo "ci/image.sh: nodedns ($1) did not start from the image" >&2
  exit 1
}
# SIGTERM to the agent ($2, or the process started last), which must exit cleanly and take its
# link along.
stop() {
  kill -TERM "${2:-$agent}"
  wait "$agent" || { cat "$work/nodedns-$1.log" >&2; echo "ci/image.sh: nodedns ($1) exited with an error" >&2; exit 1; }
  agent=
  if ip -n "$ns" link show nodelocaldns >/dev/null 2>&1; then
    echo "ci/image.sh: the link is still there after SIGTERM ($1)" >&2
    exit 1
  fi
}
expect() {
  if ! grep -q -- "$2" <<<"$3"; then
    printf '%s\n' "$3" >&2
    echo "ci/image.sh: $1: no '$2'" >&2
    exit 1
  fi
}

echo "== nodedns run from the image: nftables"
start nftables
expect "link address" "$local_ip/32" "$(ip -n "$ns" addr show nodelocaldns)"
expect "nft rules" "notrack" "$(ip netns exec "$ns" nft list table inet nodedns)"
# It answers on the link's address: SERVFAIL, as nothing listens at its upstream.
expect "an answer" "status: SERVFAIL" \
  "$(ip netns exec "$ns" dig +tries=1 +time=5 @"$local_ip" image-check.example. A || true)"
stop nftables

echo "== nodedns run from the image: iptables"
start iptables
# Whichever of the two iptables the agent picked for this namespace.
raw_rules() { ip netns exec "$ns" sh -c 'iptables-nft-save -t raw; iptables-legacy-save -t raw' 2>/dev/null; }
expect "iptables rules" "NOTRACK\|CT --notrack" "$(raw_rules)"
stop iptables
if raw_rules | grep -qi nodedns; then
  echo "ci/image.sh: iptables rules left after SIGTERM" >&2
  exit 1
fi

echo "== as node-cache's manifests run the image: /bin/sh, sleep, exec /node-cache, a preStop"
chroot "$root" /node-cache --version
# The ConfigMap's Corefile, where KubeOne mounts it (node-cache renders it into -conf).
cat >"$root/etc/coredns/Corefile.base" <<COREFILE
cluster.local:53 {
    errors
    cache 30
    bind __PILLAR__LOCAL__DNS__
    forward . __PILLAR__CLUSTER__DNS__ {
        force_tcp
    }
    health __PILLAR__LOCAL__DNS__:8080
}
.:53 {
    errors
    cache 30
    bind __PILLAR__LOCAL__DNS__
    forward . __PILLAR__UPSTREAM__SERVERS__
}
COREFILE
# KubeOne's command, verbatim but for `sleep 1` (10 there) and `--link-kind bridge` (this
# kernel has no dummy driver). Kubernetes sets the Service variable; nothing listens there.
command="sleep 1;
exec /node-cache -localip $local_ip -conf /etc/Corefile -upstreamsvc kube-dns-upstream --link-kind bridge"
log="$work/nodedns-node-cache.log"
KUBE_DNS_UPSTREAM_SERVICE_HOST=127.0.0.9 ip netns exec "$ns" unshare --mount --pid --fork --kill-child sh -c '
  root=$1; resolv=$2; shift 2
  mount -t proc proc "$root/proc" && mount --rbind /dev "$root/dev" &&
    mount -t sysfs sysfs "$root/sys" && mount --bind "$resolv" "$root/etc/resolv.conf" &&
    exec chroot "$root" "$@"' sh "$root" "$work/resolv.conf" /bin/sh -c "$command" >"$log" 2>&1 &
agent=$!
# The container's PID 1, as the host sees it: unshare's child.
pid1=
for _ in $(seq 100); do
  pid1=$(cat "/proc/$agent/task/$agent/children" 2>/dev/null | awk '{ print $1 }')
  [ -n "$pid1" ] && grep -q "serving DNS" "$log" && break
  kill -0 "$agent" 2>/dev/null || break
  sleep 0.1
done
grep -q "serving DNS" "$log" || { cat "$log" >&2; echo "ci/image.sh: /node-cache did not start under /bin/sh" >&2; exit 1; }
expect "PID 1 is nodedns, exec'd by the shell as /node-cache" "usr/bin/nodedns" "$(readlink "/proc/$pid1/exe")"
expect "PID 1's command line" "^/node-cache" "$(tr '\0' ' ' <"/proc/$pid1/cmdline")"
expect "rendered Corefile" "bind $local_ip" "$(cat "$root/etc/Corefile")"
expect "an answer" "status: SERVFAIL" \
  "$(ip netns exec "$ns" dig +tries=1 +time=5 @"$local_ip" image-check.example. A || true)"
# kubespray's preStop, as an exec hook runs: the container's namespaces and root, where PID 1
# is the agent (the shell's own `read` says so: the image has no `cat`).
in_container() { nsenter --target "$pid1" --pid --mount --net --root --wd /bin/sh -c "$1"; }
expect "PID 1 seen from inside" "^node-cache$" "$(in_container 'read -r comm </proc/1/comm && echo "$comm"')"
in_container "sleep 1 && kill -9 1" || { echo "ci/image.sh: the preStop command failed" >&2; exit 1; }
expect "an answer after the preStop" "status: SERVFAIL" \
  "$(ip netns exec "$ns" dig +tries=1 +time=5 @"$local_ip" image-check.example. A || true)"
# The runtime's SIGTERM, from outside the container.
stop node-cache "$pid1"
echo "ci/image.sh: ok"
