//! `process_*`: what the Go client's process collector reports (CoreDNS and node-cache export
//! it, and dashboards graph memory and CPU from it), read from `/proc/self` at scrape time.

use std::fmt;

use prometheus_client::encoding::{DescriptorEncoder, NoLabelSet};
use prometheus_client::metrics::MetricType;

/// The process's figures; `None` where `/proc` did not say.
#[derive(Debug, Default, PartialEq)]
struct Process {
    cpu_seconds: Option<f64>,
    resident_bytes: Option<u64>,
    virtual_bytes: Option<u64>,
    start_time_seconds: Option<f64>,
    open_fds: Option<u64>,
    max_fds: Option<u64>,
}

/// Clock ticks per second in `/proc` (`USER_HZ`: 100 on every Linux architecture's ABI).
const USER_HZ: f64 = 100.0;

impl Process {
    fn read() -> Process {
        let file = |path: &str| std::fs::read_to_string(path).ok();
        let mut p = Process::parse(
            file("/proc/self/stat").as_deref(),
            file("/proc/self/status").as_deref(),
            file("/proc/stat").as_deref(),
            file("/proc/self/limits").as_deref(),
        );
        p.open_fds = std::fs::read_dir("/proc/self/fd")
            .ok()
            .map(|d| d.count() as u64);
        p
    }

    /// Pure: the texts of `/proc/self/stat`, `/proc/self/status`, `/proc/stat` and
    /// `/proc/self/limits` (proc(5)).
    fn parse(
        stat: Option<&str>,
        status: Option<&str>,
        system: Option<&str>,
        limits: Option<&str>,
    ) -> Process {
        // Fields after the command name (which may hold spaces and parentheses): field 3 is the
        // first; utime 14, stime 15, starttime 22.
        let fields: Vec<&str> = stat
            .and_then(|s| s.rsplit_once(')'))
            .map(|(_, rest)| rest.split_whitespace().collect())
            .unwrap_or_default();
        let field = |n: usize| fields.get(n - 3).and_then(|v| v.parse::<f64>().ok());
        let kib = |key: &str| {
            status?
                .lines()
                .find_map(|l| l.strip_prefix(key))?
                .split_whitespace()
                .next()?
                .parse::<u64>()
                .ok()
                .map(|k| k * 1024)
        };
        let boot = system.and_then(|s| {
            s.lines()
                .find_map(|l| l.strip_prefix("btime "))?
                .trim()
                .parse::<f64>()
                .ok()
        });
        let max_fds = limits.and_then(|l| {
            l.lines()
                .find(|l| l.starts_with("Max open files"))?
                .split_whitespace()
                .nth(3)?
                .parse()
                .ok()
        });
        Process {
            cpu_seconds: field(14).zip(field(15)).map(|(u, s)| (u + s) / USER_HZ),
            resident_bytes: kib("VmRSS:"),
            virtual_bytes: kib("VmSize:"),
            start_time_seconds: boot.zip(field(22)).map(|(b, t)| b + t / USER_HZ),
            open_fds: None,
            max_fds,
        }
    }
}

/// Reads `/proc` and writes the `process_*` families.
pub(super) fn encode(encoder: &mut DescriptorEncoder<'_>) -> fmt::Result {
    write(encoder, &Process::read())
}

fn write(encoder: &mut DescriptorEncoder<'_>, p: &Process) -> fmt::Result {
    if let Some(v) = p.cpu_seconds {
        encoder
            .encode_descriptor(
                "process_cpu_seconds",
                "Total user and system CPU time spent in seconds.",
                None,
                MetricType::Counter,
            )?
            .encode_counter::<NoLabelSet, f64, u64>(&v, None)?;
    }
    for (name, help, v) in [
        (
            "process_open_fds",
            "Number of open file descriptors.",
            p.open_fds,
        ),
        (
            "process_max_fds",
            "Maximum number of open file descriptors.",
            p.max_fds,
        ),
        (
            "process_virtual_memory_bytes",
            "Virtual memory size in bytes.",
            p.virtual_bytes,
        ),
        (
            "process_resident_memory_bytes",
            "Resident memory size in bytes.",
            p.resident_bytes,
        ),
    ] {
        if let Some(v) = v {
            encoder
                .encode_descriptor(name, help, None, MetricType::Gauge)?
                .encode_gauge(&v)?;
        }
    }
    if let Some(v) = p.start_time_seconds {
        encoder
            .encode_descriptor(
                "process_start_time_seconds",
                "Start time of the process since unix epoch in seconds.",
                None,
                MetricType::Gauge,
            )?
            .encode_gauge(&v)?;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn process_figures_come_from_proc_texts() {
        let stat = "4242 (nodedns (udp) x) S 1 4242 4242 0 -1 4194560 1 0 0 0 250 50 0 0 20 0 9 0 12345 1000 2000";
        let status = "Name:\tnodedns\nVmSize:\t  204800 kB\nVmRSS:\t   10240 kB\n";
        let system = "cpu  1 2 3\nbtime 1700000000\n";
        let limits = "Limit                     Soft Limit           Hard Limit           Units\nMax open files            1048576              1048576              files\n";
        let p = Process::parse(Some(stat), Some(status), Some(system), Some(limits));
        assert_eq!(p.cpu_seconds, Some(3.0), "(250 + 50) ticks at 100 Hz");
        assert!((p.start_time_seconds.unwrap() - 1_700_000_123.45).abs() < 1e-6);
        assert_eq!(p.resident_bytes, Some(10240 * 1024));
        assert_eq!(p.virtual_bytes, Some(204800 * 1024));
        assert_eq!(p.max_fds, Some(1_048_576));
        assert_eq!(
            Process::parse(Some("garbage"), None, None, Some("")),
            Process::default()
        );
    }

    #[test]
    fn only_the_figures_read_are_written() {
        let mut out = String::new();
        let mut registry = prometheus_client::registry::Registry::default();
        #[derive(Debug)]
        struct Rss;
        impl prometheus_client::collector::Collector for Rss {
            fn encode(&self, mut encoder: DescriptorEncoder) -> fmt::Result {
                let p = Process {
                    resident_bytes: Some(4096),
                    ..Process::default()
                };
                write(&mut encoder, &p)
            }
        }
        registry.register_collector(Box::new(Rss));
        prometheus_client::encoding::prometheus_text::encode(&mut out, &registry).unwrap();
        assert!(
            out.contains("process_resident_memory_bytes 4096\n"),
            "{out}"
        );
        assert!(!out.contains("process_cpu_seconds"), "{out}");
    }
}
