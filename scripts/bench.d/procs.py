"""Processes, accounting and the Knot upstream, shared by scripts/bench and scripts/callgrind-hit.

Every server is started in a session of its own and found again by its process group id, so
it is measured (CPU, RSS, threads) as a whole and stopped as a whole, never by name.
"""
import os
import random
import shlex
import signal
import socket
import struct
import subprocess
import time

TICK = os.sysconf("SC_CLK_TCK")
QTYPE = {"A": 1, "NS": 2, "CNAME": 5, "SOA": 6, "PTR": 12, "AAAA": 28, "SRV": 33}


class Group:
    """A command run by `bash -c` in a new session (optionally under taskset)."""

    def __init__(self, name, command, log_path, cwd, cpus=None, env=None):
        argv = ["bash", "-c", command]
        if cpus is not None:
            argv = ["taskset", "-c", cpus] + argv
        self.name = name
        self.log_path = log_path
        self._log = open(log_path, "ab")
        self.proc = subprocess.Popen(argv, cwd=cwd, env=env, stdin=subprocess.DEVNULL,
                                     stdout=self._log, stderr=subprocess.STDOUT,
                                     start_new_session=True)
        self.pgid = self.proc.pid

    def pids(self):
        """(pid, fields of /proc/PID/stat after the command name) of every member."""
        out = []
        for entry in os.listdir("/proc"):
            if not entry.isdigit():
                continue
            try:
                with open("/proc/%s/stat" % entry) as f:
                    stat = f.read()
            except OSError:
                continue
            fields = stat[stat.rindex(")") + 2:].split()
            if int(fields[2]) == self.pgid:          # field 5, pgrp
                out.append((int(entry), fields))
        return out

    def cpu_seconds(self):
        """utime + stime of every member, with the children they reaped (cutime, cstime)."""
        return sum(sum(int(x) for x in f[11:15]) for _, f in self.pids()) / TICK

    def memory_kb(self):
        """(VmRSS, VmHWM) summed over the members."""
        rss = hwm = 0
        for pid, _ in self.pids():
            try:
                with open("/proc/%d/status" % pid) as f:
                    for line in f:
                        if line.startswith("VmRSS:"):
                            rss += int(line.split()[1])
                        elif line.startswith("VmHWM:"):
                            hwm += int(line.split()[1])
            except OSError:
                pass
        return rss, hwm

    def threads(self):
        total = 0
        for pid, _ in self.pids():
            try:
                total += len(os.listdir("/proc/%d/task" % pid))
            except OSError:
                pass
        return total

    def alive(self):
        return self.proc.poll() is None

    def log_tail(self, chars=1500):
        try:
            with open(self.log_path, errors="replace") as f:
                return f.read()[-chars:]
        except OSError:
            return ""

    def stop(self, grace=5.0):
        """SIGTERM to the group, SIGKILL after `grace` seconds; waits until no member is left."""
        for sig, wait in ((signal.SIGTERM, grace), (signal.SIGKILL, 3.0)):
            try:
                os.killpg(self.pgid, sig)
            except ProcessLookupError:
                break
            deadline = time.monotonic() + wait
            while time.monotonic() < deadline and self.pids():
                self.proc.poll()
                time.sleep(0.05)
            if not self.pids():
                break
        self.proc.poll()
        self._log.close()


def port_free(ip, port):
    """True when nothing holds `port` on `ip` for UDP or TCP."""
    for kind in (socket.SOCK_DGRAM, socket.SOCK_STREAM):
        s = socket.socket(socket.AF_INET, kind)
        if kind == socket.SOCK_STREAM:
            # TIME-WAIT leftovers of an earlier run do not stop a server binding (SO_REUSEADDR).
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((ip, port))
        except OSError:
            return False
        finally:
            s.close()
    return True


def encode_query(name, qtype, qid):
    labels = b"".join(bytes([len(p)]) + p.encode() for p in name.rstrip(".").split(".") if p)
    return struct.pack(">HHHHHH", qid, 0x0100, 1, 0, 0, 0) + labels + b"\0" + struct.pack(
        ">HH", QTYPE[qtype], 1)


def query(ip, port, name, qtype="A", timeout=1.0):
    """One UDP query; (rcode, answer count) or None on timeout/error."""
    qid = random.randrange(1 << 16)
    s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    s.settimeout(timeout)
    try:
        s.sendto(encode_query(name, qtype, qid), (ip, port))
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            reply = s.recv(4096)
            if len(reply) >= 12 and struct.unpack(">H", reply[:2])[0] == qid and reply[2] & 0x80:
                flags, _, ancount = struct.unpack(">HHH", reply[2:8])
                return flags & 0xF, ancount
    except OSError:
        return None
    finally:
        s.close()
    return None


def outcome(reply):
    if reply is None:
        return "timeout"
    rcode, ancount = reply
    if rcode == 3:
        return "nxdomain"
    if rcode == 0:
        return "answer" if ancount else "nodata"
    return "rcode%d" % rcode


def wait_answering(ip, port, group, name="kubernetes.default.svc.cluster.local", limit=20.0):
    """True once the server answers `name`; False if it exits or `limit` passes."""
    deadline = time.monotonic() + limit
    while time.monotonic() < deadline:
        if not group.alive():
            return False
        if query(ip, port, name, "A", 0.3) is not None:
            return True
        time.sleep(0.1)
    return False


def check_answers(ip, port, check_file):
    """Asks every `name type expected` line of check_file; returns the mismatches."""
    wrong = []
    with open(check_file) as f:
        for line in f:
            name, qtype, want = line.split()
            got = outcome(query(ip, port, name, qtype, 2.0))
            if got != want:
                wrong.append("%s %s: want %s, got %s" % (name, qtype, want, got))
    return wrong


def machine_cpu():
    """(busy, steal) seconds of the whole machine so far, from /proc/stat."""
    with open("/proc/stat") as f:
        v = [int(x) for x in f.readline().split()[1:9]]
    steal = v[7]
    return (sum(v) - v[3] - v[4] - steal) / TICK, steal / TICK


def loadavg():
    """The machine's 1-minute load average (how many others wanted the CPUs)."""
    with open("/proc/loadavg") as f:
        return float(f.read().split()[0])


def udp_rcvbuf_errors():
    with open("/proc/net/snmp") as f:
        rows = [line.split() for line in f if line.startswith("Udp:")]
    return int(dict(zip(rows[0][1:], rows[1][1:])).get("RcvbufErrors", 0))


KNOT_CONF = """\
# Knot DNS standing in for CoreDNS: authoritative for the synthetic zones, UDP and TCP.
server:
    rundir: "{rundir}"
    listen: {ip}@{port}
    udp-workers: {workers}
    tcp-workers: {workers}
    background-workers: 1
    tcp-max-clients: 2048
control:
    listen: "{rundir}/knot.sock"
log:
  - target: stderr
    any: warning
database:
    storage: "{rundir}/db"
mod-stats:
  - id: counters
    request-protocol: on
    server-operation: off
    request-bytes: off
    response-bytes: off
    edns-presence: off
    flag-presence: off
    response-code: off
    query-type: off
    query-size: off
    reply-size: off
template:
  - id: default
    storage: "{zonedir}"
    file: "%s.zone"
    semantic-checks: off
    zonefile-sync: -1
    journal-content: none
    global-module: mod-stats/counters
zone:
{zones}"""


class Knot:
    """The upstream: knotd on ip:port, with per-protocol query counters."""

    def __init__(self, workdir, datadir, zones, ip, port, cpus=None, workers=2):
        self.rundir = os.path.join(workdir, "knot")
        os.makedirs(os.path.join(self.rundir, "db"), exist_ok=True)
        conf = os.path.join(self.rundir, "knot.conf")
        with open(conf, "w") as f:
            f.write(KNOT_CONF.format(rundir=self.rundir, ip=ip, port=port, workers=workers,
                                     zonedir=os.path.join(datadir, "zones"),
                                     zones="".join("  - domain: %s\n" % z for z in zones)))
        self.sock = os.path.join(self.rundir, "knot.sock")
        self.group = Group("knotd", "exec knotd -c %s" % shlex.quote(conf),
                           os.path.join(workdir, "knotd.log"), self.rundir, cpus)
        if not wait_answering(ip, port, self.group):
            tail = self.group.log_tail()
            self.group.stop()
            raise RuntimeError("knotd did not start:\n" + tail)

    def counters(self):
        """{'udp': n, 'tcp': n} queries answered so far."""
        out = subprocess.run(["knotc", "-s", self.sock, "stats", "mod-stats"], capture_output=True,
                             text=True, timeout=10).stdout
        seen = {"udp": 0, "tcp": 0}
        for line in out.splitlines():
            key, _, value = line.partition("=")
            if "request-protocol[" in key:
                proto = key.split("[", 1)[1].rstrip("] ")
                seen["tcp" if proto.startswith("tcp") else "udp"] += int(value)
        return seen

    def stop(self):
        self.group.stop()
