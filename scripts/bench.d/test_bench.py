"""Tests of scripts/bench, scripts/callgrind-hit and scripts/callgrind-miss.

    python3 scripts/bench.d/test_bench.py            # everything (the smoke run takes ~40 s)
    NODEDNS_BENCH_SMOKE=0 python3 scripts/bench.d/test_bench.py   # without the smoke run

The smoke run starts real servers (knotd, dnsdist, unbound, the echo ceiling and nodedns from
target/release, else target/debug, or $NODEDNS_BIN) on loopback ports 26900+, so it needs the Debian
packages and a build; it is skipped, saying why, when they are missing.
"""
import importlib.machinery
import importlib.util
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
import unittest

HERE = os.path.dirname(os.path.abspath(__file__))
SCRIPTS = os.path.dirname(HERE)
REPO = os.path.dirname(SCRIPTS)
sys.dont_write_bytecode = True         # no __pycache__ in the source tree
sys.path.insert(0, HERE)
import data  # noqa: E402
import procs  # noqa: E402


def load(name):
    loader = importlib.machinery.SourceFileLoader(name.replace("-", "_"), os.path.join(SCRIPTS, name))
    spec = importlib.util.spec_from_loader(loader.name, loader)
    module = importlib.util.module_from_spec(spec)
    loader.exec_module(module)
    return module


bench = load("bench")
callgrind = load("callgrind-hit")
miss = load("callgrind-miss")

DNSPERF_OUTPUT = """\
[Status] Command line: dnsperf -s 127.0.0.1 -p 26311 -d hot.txt -l 1 -Q 50 -v
> NOERROR api.example.com A 0.000220
> NXDOMAIN api.example.com.cluster.local AAAA 0.000082
> NOERROR www.example.com A 0.004178
> SERVFAIL broken.example.com A 0.001000
[Status] Testing complete (time limit)

Statistics:

  Queries sent:         5
  Queries completed:    4 (80.00%)
  Queries lost:         1 (20.00%)

  Response codes:       NOERROR 2 (50.00%), NXDOMAIN 1 (25.00%), SERVFAIL 1 (25.00%)
  Average packet size:  request 50, response 93
  Run time (s):         1.000095
  Queries per second:   3.999620

  Average Latency (s):  0.001370 (min 0.000082, max 0.004178)
  Latency StdDev (s):   0.000594
"""


class Numbers(unittest.TestCase):
    def test_percentile_is_nearest_rank(self):
        xs = list(range(1, 101))
        self.assertEqual(bench.percentile(xs, 50), 50)
        self.assertEqual(bench.percentile(xs, 99), 99)
        self.assertEqual(bench.percentile(xs, 99.9), 100)
        self.assertEqual(bench.percentile([7], 99), 7)
        self.assertIsNone(bench.percentile([], 50))

    def test_dnsperf_summary_rcodes_and_latencies_are_parsed(self):
        r, lat = bench.parse_dnsperf(DNSPERF_OUTPUT)
        self.assertEqual((r["sent"], r["completed"], r["lost"]), (5, 4, 1))
        self.assertAlmostEqual(r["qps"], 3.99962)
        self.assertEqual(r["rcodes"], {"NOERROR": 2, "NXDOMAIN": 1, "SERVFAIL": 1})
        self.assertEqual(lat, [0.000082, 0.000220, 0.001, 0.004178])

    def test_a_lost_query_is_slower_than_every_answered_one(self):
        lat = [0.0001] * 99 + [0.0002]
        self.assertEqual(bench.latency_summary(lat, 0)["p99_us"], 100.0)
        # 100 answered + 1 lost: p99 moves up to the slowest answer, p99.9 is the loss (no figure).
        s = bench.latency_summary(lat, 1)
        self.assertEqual(s["p99_us"], 200.0)
        self.assertIsNone(s["p999_us"])
        # Two lost out of 100: p99 itself is a loss.
        self.assertIsNone(bench.latency_summary(lat[:98], 2)["p99_us"])

    def test_garbage_from_dnsperf_gives_no_figures_rather_than_an_error(self):
        r, lat = bench.parse_dnsperf("> NOERROR x A notanumber\nQueries sent: lots\n\x00\n")
        self.assertEqual(lat, [])
        self.assertNotIn("sent", r)
        self.assertEqual(bench.latency_summary(lat, 3), {})


class Starved(unittest.TestCase):
    def test_a_run_is_starved_when_dnsperf_overran_the_machine_flooded_or_the_rate_was_missed(self):
        ok = {"qps": 9990.0, "sent": 50000, "offered_qps": 10000, "udp_rcvbuf_drops": 300}
        self.assertEqual(bench.starved(ok), "")
        self.assertIn("overran", bench.starved(dict(ok, overran=True)))
        self.assertIn("overran", bench.starved(dict(ok, qps=None)))
        self.assertIn("UDP drops", bench.starved(dict(ok, udp_rcvbuf_drops=1250000)))
        self.assertIn("qps sent", bench.starved(dict(ok, qps=4651.8)))
        # A closed-loop run has no offered rate; a slow server is not a starved machine.
        self.assertEqual(bench.starved({"qps": 900.0, "sent": 8000, "udp_rcvbuf_drops": 0}), "")


class Data(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        cls.dir = tempfile.mkdtemp(prefix="bench-test.")
        cls.mix = data.generate(cls.dir)

    @classmethod
    def tearDownClass(cls):
        shutil.rmtree(cls.dir)

    def test_the_hot_file_is_the_kubernetes_pod_mix(self):
        m = self.mix
        self.assertGreater(m["queries"], 45000)
        self.assertTrue(5500 <= m["distinct"] <= 7000, m["distinct"])
        share = m["share_percent"]
        self.assertAlmostEqual(sum(share.values()), 100.0, delta=0.2)
        # Search-list expansion makes NXDOMAIN the most common answer.
        self.assertGreater(share["nxdomain"], 50)
        with open(os.path.join(self.dir, "hot.txt")) as f:
            lines = f.read().splitlines()
        self.assertEqual(len(lines), m["queries"])
        self.assertTrue(all(line.split()[1] in procs.QTYPE for line in lines))

    def test_short_names_walk_the_search_list_and_long_ones_go_first_as_written(self):
        self.assertEqual(data.candidates("redis", "web"), [
            "redis.web.svc.cluster.local", "redis.svc.cluster.local", "redis.cluster.local", "redis"])
        five = "_http._tcp.redis.web.svc.cluster.local"
        self.assertEqual(data.candidates(five, "web")[0], five)

    def test_generation_is_deterministic_for_a_seed(self):
        other = tempfile.mkdtemp(prefix="bench-test.")
        try:
            data.generate(other)
            for name in ("hot.txt", "check.txt", "zones/cluster.local.zone"):
                with open(os.path.join(self.dir, name)) as a, open(os.path.join(other, name)) as b:
                    self.assertEqual(a.read(), b.read(), name)
        finally:
            shutil.rmtree(other)

    def test_unique_files_never_share_a_name(self):
        a, b = os.path.join(self.dir, "a.txt"), os.path.join(self.dir, "b.txt")
        data.unique_names(a, 5000, "m", 1)
        data.unique_names(b, 5000, "l", 1)
        with open(a) as fa, open(b) as fb:
            na, nb = fa.read().splitlines(), fb.read().splitlines()
        self.assertEqual(len(set(na)), 5000)
        self.assertFalse(set(na) & set(nb))

    def test_cached_names_are_distinct_wildcard_answers(self):
        path = os.path.join(self.dir, "c.txt")
        data.cached_names(path, 3000, 7)
        with open(path) as f:
            names = f.read().splitlines()
        self.assertEqual(len(set(names)), 3000)
        self.assertTrue(all(n.endswith(".scale.example.org A") for n in names))

    @unittest.skipUnless(shutil.which("knotd") or os.path.exists("/usr/sbin/knotd"), "knotd not installed")
    def test_knot_answers_what_the_generator_expects(self):
        os.environ["PATH"] += os.pathsep + "/usr/sbin"
        work = tempfile.mkdtemp(prefix="bench-test.")
        port = free_port_pair(26950)
        knot = procs.Knot(work, self.dir, self.mix["zones"], "127.0.0.1", port)
        try:
            wrong = procs.check_answers("127.0.0.1", port, os.path.join(self.dir, "check.txt"))
            self.assertEqual(wrong, [])
            before = knot.counters()
            procs.query("127.0.0.1", port, "kubernetes.default.svc.cluster.local", "A")
            self.assertEqual(sum(knot.counters().values()), sum(before.values()) + 1)
        finally:
            knot.stop()
            shutil.rmtree(work)


class Callgrind(unittest.TestCase):
    DUMP = """\
# callgrind format
events: Ir
summary: 1000
fl=(1) a.rs
fn=(1) outer
1 100
+2 50
cfl=(1)
cfn=(2) inner
calls=10 5
3 700
fn=(2)
5 140
fi=(2) inlined.rs
6 10
"""

    def test_self_cost_skips_call_costs_and_resolves_compressed_names(self):
        with tempfile.NamedTemporaryFile("w", suffix=".out", delete=False) as f:
            f.write(self.DUMP)
        try:
            self.assertEqual(callgrind.self_cost(f.name), {"outer": 150, "inner": 150})
            self.assertEqual(callgrind.totals(f.name), 1000)
            with self.assertRaises(RuntimeError):
                callgrind.totals(f.name, "Ge")
        finally:
            os.unlink(f.name)

    def test_totals_reads_the_column_of_the_event_asked_for(self):
        with tempfile.NamedTemporaryFile("w", suffix=".out", delete=False) as f:
            f.write("events: Ir Ge\nsummary: 1000 7\ntotals: 1000 7\n")
        try:
            self.assertEqual(callgrind.totals(f.name), 1000)
            self.assertEqual(callgrind.totals(f.name, "Ge"), 7)
        finally:
            os.unlink(f.name)

    def test_dnsperf_counts_reads_the_queries_answered_and_lost(self):
        report = """\
Statistics:

  Queries sent:         50013
  Queries completed:    50011 (100.00%)
  Queries lost:         2 (0.00%)

  Response codes:       NOERROR 22802 (45.59%), NXDOMAIN 27209 (54.41%)
"""
        self.assertEqual(callgrind.dnsperf_counts(report), (50011, 2))
        with self.assertRaises(RuntimeError):
            callgrind.dnsperf_counts("dnsperf: cannot open file")


class CallgrindMiss(unittest.TestCase):
    STRACE = """\
% time     seconds  usecs/call     calls    errors syscall
------ ----------- ----------- --------- --------- ----------------
 61.20    0.012000           3      4000      1900 recvfrom
 20.10    0.004000           2      2000           sendto
  0.00    0.000000           0         1         1 access
------ ----------- ----------- --------- --------- ----------------
100.00    0.016000           2      6001      1901 total
"""

    def test_strace_counts_read_calls_by_name_with_or_without_errors(self):
        with tempfile.NamedTemporaryFile("w", suffix=".txt", delete=False) as f:
            f.write(self.STRACE)
        try:
            self.assertEqual(miss.strace_counts(f.name), {"recvfrom": 4000, "sendto": 2000, "access": 1})
        finally:
            os.unlink(f.name)

    def test_frames_leave_the_allocator_out(self):
        fs = ["[root]",
              "0x48417B4: malloc (in /usr/libexec/valgrind/vgpreload_dhat-amd64-linux.so)",
              "0x7E1F6B: alloc (library/alloc/src/alloc.rs:95)",
              "0x742171: nodedns_cache::store::Cache::store (store.rs:293)",
              "0x742172: nodedns_agent::serve::pipeline::fetch::{{closure}} (pipeline.rs:702)"]
        self.assertEqual(miss.frames(fs), ["nodedns_cache::store::Cache::store (store.rs:293)",
                                           "nodedns_agent::serve::pipeline::fetch::{{closure}} (pipeline.rs:702)"])


def free_port_pair(start):
    for port in range(start, start + 40, 2):
        if procs.port_free("127.0.0.1", port):
            return port
    raise unittest.SkipTest("no free port near %d" % start)


@unittest.skipIf(os.environ.get("NODEDNS_BENCH_SMOKE") == "0", "NODEDNS_BENCH_SMOKE=0")
class Smoke(unittest.TestCase):
    def test_quick_run_prints_every_figure_for_every_peer(self):
        # The smoke run checks the script, not the speed: any build will do (release first).
        builds = [os.path.join(REPO, "target", p, "nodedns") for p in ("release", "debug")]
        binary = os.environ.get("NODEDNS_BIN") or next((b for b in builds if os.access(b, os.X_OK)), None)
        if binary is None:
            self.skipTest("no nodedns build (cargo build -p nodedns-agent)")
        for tool in ("dnsperf", "dnsdist", "unbound", "knotd", "gcc"):
            if not (shutil.which(tool) or os.path.exists("/usr/sbin/" + tool)):
                self.skipTest("%s not installed" % tool)
        out = tempfile.mkdtemp(prefix="bench-test.")
        try:
            t0 = time.monotonic()
            p = subprocess.run([sys.executable, os.path.join(SCRIPTS, "bench"), "--quick", "--out", out,
                                "--base-port", "26900", "--nodedns", binary], capture_output=True, text=True, timeout=300)
            took = time.monotonic() - t0
            self.assertEqual(p.returncode, 0, p.stderr[-3000:])
            # A bound on runaway, not a speed goal: --quick takes ~35 s on an idle machine, more
            # with a debug build or a busy CI host.
            self.assertLess(took, 240, "--quick took %.0f s" % took)
            table = [line for line in p.stdout.splitlines() if line.startswith("| ")]
            header = table[0].split(" | ")
            self.assertEqual(header[1:5], ["echo", "nodedns", "dnsdist", "unbound"])
            rows = {line.split(" | ")[0][2:]: line.split(" | ") for line in table}
            hit = next(v for k, v in rows.items() if k.startswith("hit QPS"))
            self.assertTrue(all(float(x) > 0 for x in hit[1:5]), hit)
            miss = next(v for k, v in rows.items() if k.startswith("miss QPS"))
            self.assertEqual(miss[1], "-")
            self.assertTrue(all(float(x) > 0 for x in miss[2:5]), miss)
            with open(os.path.join(out, "results.jsonl")) as f:
                recs = [json.loads(line) for line in f]
            # A run on a starved machine is measured again; the first one is kept as `_discarded`.
            nodedns = {r["phase"]: r for r in recs
                       if r["peer"] == "nodedns" and not r["phase"].endswith("_discarded")}
            self.assertEqual(set(nodedns), {"hit_sat", "hit_lat", "miss_sat", "miss_lat"})
            self.assertEqual(nodedns["hit_sat"]["check_mismatches"], 0)
            # Hits stay in the cache; every unique name goes upstream once, over TCP.
            self.assertEqual(nodedns["hit_sat"]["upstream_q"], 0)
            self.assertEqual(nodedns["hit_sat"]["cache_hits"], nodedns["hit_sat"]["completed"])
            miss = nodedns["miss_sat"]
            self.assertEqual(miss["upstream_tcp_q"], miss["upstream_q"])
            self.assertGreaterEqual(miss["upstream_q"], miss["completed"])
            # The report can be printed again from the folder.
            again = subprocess.run([sys.executable, os.path.join(SCRIPTS, "bench"), "--report", out],
                                   capture_output=True, text=True, timeout=30)
            self.assertEqual(again.stdout.strip(), p.stdout.strip())
        finally:
            shutil.rmtree(out)


if __name__ == "__main__":
    unittest.main()
