"""Synthetic upstream zones and dnsperf query files for scripts/bench and scripts/callgrind-hit.

The upstream (Knot, standing in for CoreDNS) serves a small cluster and a few external zones:

* `cluster.local`: NAMESPACES x SERVICES_PER_NS services, `<svc>.<ns>.svc.cluster.local A`;
  every 5th service is headless (three pod IPs), every 3rd has `_http._tcp` SRV.
* `96.10.in-addr.arpa`: a PTR for every service's cluster IP.
* `example.com`, `example.org`, `example.net`: 20 names each, every other one with AAAA,
  every 4th (from the 2nd) a CNAME to `<name>-lb`; `*.wild.example.org A` (the miss path's
  answers) and `*.scale.example.org A` (the scaling runs' cached names).

The hot file replays pod lookups under the resolv.conf every pod gets:

    search <ns>.svc.cluster.local svc.cluster.local cluster.local
    options ndots:5

as glibc resolves them: a name with fewer than 5 dots is tried with each search suffix first and
as written last; each candidate is asked as A and AAAA; the walk stops at the first candidate
that exists (an answer or NODATA). Popularity of namespaces, services and external names is
Zipf-like, so the file has a few thousand distinct queries that repeat.

Every other file holds names no other file holds (a distinct first label per file), so a run
that must miss never finds what an earlier run cached.
"""
import json
import os
import random

NEG_TTL_DEFAULT = 300
TTL_DEFAULT = 300

NAMESPACES = [
    "default", "kube-system", "monitoring", "ingress", "payments", "orders", "checkout",
    "catalog", "search", "users", "auth", "mail", "analytics", "ml", "batch", "data", "web",
    "gateway", "billing", "shipping", "inventory", "crm", "media", "ops",
]
SERVICES = [
    "api", "web", "frontend", "backend", "worker", "cron", "proxy", "redis", "postgres",
    "mysql", "kafka", "zookeeper", "elastic", "prometheus", "grafana", "alerts", "loki",
    "tempo", "auth", "users", "orders", "payments", "cart", "catalog", "search", "stock",
    "ship", "email", "sms", "metrics", "cache", "memcached", "rabbitmq", "mongo", "etcd",
    "vault", "consul", "nats", "minio", "recommend", "ledger", "pricing", "profile",
    "session", "queue", "notify", "report", "export", "import", "config", "flags",
]
EXTERNAL_LABELS = {
    "example.com": ["api", "www", "auth", "cdn", "s3", "login", "static", "img", "pay", "mail",
                    "oauth", "events", "telemetry", "registry", "hooks", "status", "docs",
                    "accounts", "storage", "push"],
    "example.org": ["api", "www", "sso", "repo", "mirror", "pypi", "npm", "charts", "grafana",
                    "sentry", "logs", "ntp", "smtp", "vault", "ci", "git", "wiki", "chat", "cdn",
                    "objects"],
    "example.net": ["api", "www", "edge", "ads", "track", "geo", "maps", "ws", "rtc", "media",
                    "video", "fonts", "js", "cdn", "license", "update", "crash", "ota", "time",
                    "id"],
}
# What pods look up, per 100 lookups.
LOOKUP_MIX = (
    ("service", 45),        # "redis": found under the pod's own namespace suffix
    ("service_ns", 10),     # "redis.payments": one NXDOMAIN step, then svc.cluster.local
    ("service_fqdn", 5),    # "redis.payments.svc.cluster.local" (4 dots): walks every suffix
    ("external", 30),       # "api.example.com": three NXDOMAIN steps, then the name
    ("srv", 5),             # "_http._tcp.redis.payments.svc.cluster.local" SRV (6 dots: as written)
    ("ptr", 5),             # reverse lookup of a service IP (absolute)
)
NDOTS = 5


class Cluster:
    """The names the upstream serves, and which (name, type) pairs exist."""

    def __init__(self, rng, namespaces=20, services_per_ns=15):
        self.namespaces = NAMESPACES[:namespaces]
        self.services = {}      # ns -> [svc], most popular first
        self.addrs = {}         # (svc, ns) -> [A records]
        self.vip = {}           # (svc, ns) -> cluster IP (for PTR)
        self.srv = []           # (svc, ns) with an _http._tcp SRV
        serial = 0
        for ns in self.namespaces:
            names = rng.sample(SERVICES, services_per_ns)
            if ns == "default":
                names[0] = "kubernetes"
            elif ns == "kube-system":
                names[0] = "kube-dns"
            self.services[ns] = names
            for i, svc in enumerate(names):
                serial += 1
                vip = "10.96.%d.%d" % (serial >> 8, serial & 0xFF)
                self.vip[(svc, ns)] = vip
                if i % 5 == 4:
                    self.addrs[(svc, ns)] = ["10.244.%d.%d" % (rng.randrange(256), rng.randrange(1, 255))
                                             for _ in range(3)]
                else:
                    self.addrs[(svc, ns)] = [vip]
                if i % 3 == 0:
                    self.srv.append((svc, ns))
        self.external = []      # (name, has_aaaa, cname target or None)
        for zone, labels in EXTERNAL_LABELS.items():
            for i, label in enumerate(labels):
                target = "%s-lb.%s" % (label, zone) if i % 4 == 1 else None
                self.external.append(("%s.%s" % (label, zone), i % 2 == 0, target))
        self.types = {}         # owner -> set of types ("" marks an empty non-terminal)
        self.wildcards = {"wild.example.org": "A", "scale.example.org": "A"}

    def own(self, name, rtype):
        self.types.setdefault(name, set()).add(rtype)
        labels = name.split(".")
        for i in range(1, len(labels)):
            self.types.setdefault(".".join(labels[i:]), set())

    def outcome(self, name, qtype):
        """What the zones answer: 'answer', 'nodata' or 'nxdomain'."""
        if name in self.types:
            have = self.types[name]
            return "answer" if qtype in have or "CNAME" in have else "nodata"
        for parent, wtype in self.wildcards.items():
            if name.endswith("." + parent) and name[: -len(parent) - 1].count(".") == 0:
                return "answer" if qtype == wtype else "nodata"
        return "nxdomain"


def write_zones(cluster, outdir, rng, ttl, neg_ttl):
    """Writes zones/<zone>.zone; returns the zone names."""
    zdir = os.path.join(outdir, "zones")
    os.makedirs(zdir, exist_ok=True)
    zones = {}

    def open_zone(origin):
        lines = ["$ORIGIN %s." % origin, "$TTL %d" % ttl,
                 "@ SOA ns.%s. hostmaster.%s. 1 3600 600 86400 %d" % (origin, origin, neg_ttl),
                 "@ NS ns", "ns A 127.0.0.1"]
        cluster.own(origin, "SOA")
        cluster.own(origin, "NS")
        cluster.own("ns." + origin, "A")
        zones[origin] = lines
        return lines

    z = open_zone("cluster.local")
    for ns, names in cluster.services.items():
        for svc in names:
            owner = "%s.%s.svc" % (svc, ns)
            z.extend("%s A %s" % (owner, ip) for ip in cluster.addrs[(svc, ns)])
            cluster.own(owner + ".cluster.local", "A")
            if (svc, ns) in cluster.srv:
                z.append("_http._tcp.%s SRV 0 100 80 %s.cluster.local." % (owner, owner))
                cluster.own("_http._tcp.%s.cluster.local" % owner, "SRV")
    z = open_zone("96.10.in-addr.arpa")
    for (svc, ns), vip in cluster.vip.items():
        o = vip.split(".")
        z.append("%s.%s PTR %s.%s.svc.cluster.local." % (o[3], o[2], svc, ns))
        cluster.own("%s.%s.96.10.in-addr.arpa" % (o[3], o[2]), "PTR")
    for zone in EXTERNAL_LABELS:
        z = open_zone(zone)
        for name, has_aaaa, target in cluster.external:
            if not name.endswith("." + zone):
                continue
            holder = name
            if target:
                z.append("%s. CNAME %s." % (name, target))
                cluster.own(name, "CNAME")
                holder = target
            z.append("%s. A 192.0.2.%d" % (holder, rng.randrange(1, 255)))
            cluster.own(holder, "A")
            if has_aaaa:
                z.append("%s. AAAA 2001:db8::%x" % (holder, rng.randrange(1, 0xFFFF)))
                cluster.own(holder, "AAAA")
    for parent, wtype in cluster.wildcards.items():
        zones["example.org"].append("*.%s. %s 192.0.2.250" % (parent, wtype))
        cluster.own(parent, "")
    for origin, lines in zones.items():
        with open(os.path.join(zdir, origin + ".zone"), "w") as f:
            f.write("\n".join(lines) + "\n")
    return sorted(zones)


def candidates(name, pod_ns):
    """The names glibc tries for `name` under the pod resolv.conf, in order."""
    search = ("%s.svc.cluster.local" % pod_ns, "svc.cluster.local", "cluster.local")
    expanded = ["%s.%s" % (name, s) for s in search]
    return [name] + expanded if name.count(".") >= NDOTS else expanded + [name]


def zipf(n, s):
    return [1.0 / (k + 1) ** s for k in range(n)]


def pod_lookup(cluster, rng, kind, w):
    """The (name, type) queries one pod lookup sends."""
    pod_ns = rng.choices(cluster.namespaces, w["ns"])[0]
    if kind == "srv":
        svc, ns = cluster.srv[rng.randrange(len(cluster.srv))]
        return [("_http._tcp.%s.%s.svc.cluster.local" % (svc, ns), "SRV")]
    if kind == "ptr":
        vips = sorted(cluster.vip.values())
        o = vips[rng.randrange(len(vips))].split(".")
        return [("%s.%s.%s.%s.in-addr.arpa" % (o[3], o[2], o[1], o[0]), "PTR")]
    if kind == "external":
        name = rng.choices(cluster.external, w["ext"])[0][0]
    else:
        ns = pod_ns if kind == "service" else rng.choices(cluster.namespaces, w["ns"])[0]
        svc = rng.choices(cluster.services[ns], w["svc"][: len(cluster.services[ns])])[0]
        name = {"service": svc, "service_ns": "%s.%s" % (svc, ns),
                "service_fqdn": "%s.%s.svc.cluster.local" % (svc, ns)}[kind]
    sent = []
    for cand in candidates(name, pod_ns):
        sent += [(cand, "A"), (cand, "AAAA")]
        if cluster.outcome(cand, "A") != "nxdomain":
            break
    return sent


def unique_names(path, count, tag, seed):
    """`count` names nobody asked before: 2/4 `<r>.example.com A` (NXDOMAIN), 1/4
    `<r>.wild.example.org A` (wildcard answer), 1/4 `<r>.example.net AAAA` (NXDOMAIN)."""
    rng = random.Random(seed)
    with open(path, "w") as f:
        for i in range(count):
            label = "%s%x%s" % (tag, i, "".join(rng.choice("abcdefghijklmnopqrstuvwxyz") for _ in range(4)))
            f.write(("%s.example.com A\n", "%s.wild.example.org A\n",
                     "%s.example.com A\n", "%s.example.net AAAA\n")[i % 4] % label)


def cached_names(path, count, seed):
    """`count` distinct names that all exist (wildcard A answers), shuffled: the working set of
    a scaling run."""
    order = list(range(count))
    random.Random(seed).shuffle(order)
    with open(path, "w") as f:
        f.writelines("s%x.scale.example.org A\n" % i for i in order)


def generate(outdir, seed=1, lookups=12000, ttl=TTL_DEFAULT, neg_ttl=NEG_TTL_DEFAULT,
             namespaces=20, services_per_ns=15):
    """Writes the zones, hot.txt and check.txt; returns the mix summary (also in mix.json)."""
    os.makedirs(outdir, exist_ok=True)
    rng = random.Random(seed)
    cluster = Cluster(rng, namespaces, services_per_ns)
    zones = write_zones(cluster, outdir, rng, ttl, neg_ttl)
    w = {"ns": zipf(len(cluster.namespaces), 0.8), "svc": zipf(services_per_ns, 1.0),
         "ext": zipf(len(cluster.external), 1.0)}
    kinds = [k for k, _ in LOOKUP_MIX]
    weights = [p for _, p in LOOKUP_MIX]
    outcomes = {"answer": 0, "nodata": 0, "nxdomain": 0}
    seen = {}
    total = 0
    with open(os.path.join(outdir, "hot.txt"), "w") as f:
        for _ in range(lookups):
            for name, qtype in pod_lookup(cluster, rng, rng.choices(kinds, weights)[0], w):
                f.write("%s %s\n" % (name, qtype))
                total += 1
                out = cluster.outcome(name, qtype)
                outcomes[out] += 1
                seen[(name, qtype)] = out
    sample = sorted(seen.items())
    rng.shuffle(sample)
    with open(os.path.join(outdir, "check.txt"), "w") as f:
        for (name, qtype), out in sample[:80]:
            f.write("%s %s %s\n" % (name, qtype, out))
        f.write("check%x.example.com A nxdomain\n" % rng.randrange(1 << 32))
        f.write("check%x.wild.example.org A answer\n" % rng.randrange(1 << 32))
        f.write("check%x.wild.example.org AAAA nodata\n" % rng.randrange(1 << 32))
    mix = {
        "lookups": lookups, "queries": total, "distinct": len(seen),
        "share_percent": {k: round(100.0 * v / total, 1) for k, v in outcomes.items()},
        "lookup_mix_percent": dict(LOOKUP_MIX), "zones": zones, "ttl": ttl, "neg_ttl": neg_ttl,
        "services": sum(len(v) for v in cluster.services.values()),
    }
    with open(os.path.join(outdir, "mix.json"), "w") as f:
        json.dump(mix, f, indent=1)
    return mix


if __name__ == "__main__":
    import sys
    print(json.dumps(generate(sys.argv[1] if len(sys.argv) > 1 else "bench-data"), indent=1))
