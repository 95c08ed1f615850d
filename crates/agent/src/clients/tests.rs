use super::*;

fn args(k: usize, sample: u32) -> Args {
    Args {
        clients_top: k,
        clients_sample: sample,
        cluster_domain: Some("cluster.local.".to_owned()),
        ..Args::default()
    }
}

fn ip(text: &str) -> IpAddr {
    text.parse().unwrap()
}

fn wire(text: &str) -> Vec<u8> {
    name::wire(text).unwrap()
}

fn seen<'a>(client: &str, qname: &'a [u8], rcode: u8, path: Path) -> Seen<'a> {
    Seen {
        client: ip(client),
        qname,
        rcode,
        path,
    }
}

fn exposition(board: &Arc<Board>) -> String {
    let mut registry = prometheus_client::registry::Registry::default();
    registry.register_collector(Box::new(Collector(board.clone())));
    let mut text = String::new();
    prometheus_client::encoding::text::encode(&mut text, &registry).unwrap();
    text
}

#[test]
fn known_volumes_from_several_clients_end_in_exact_ordered_figures() {
    let board = Arc::new(Board::new(args(3, 1)));
    // Two trackers, as two UDP workers: each client's queries are split between them.
    let (a, b) = (board.worker().unwrap(), board.worker().unwrap());
    let now = Instant::now();
    let hit = wire("kube-dns.kube-system.svc.cluster.local");
    let cascade = [
        wire("api.example.com.default.svc.cluster.local"),
        wire("api.example.com.svc.cluster.local"),
        wire("api.example.com.cluster.local"),
    ];
    let outside_nx = wire("nothing.example.com");
    for i in 0..100 {
        let tracker = if i % 2 == 0 { &a } else { &b };
        // 127.0.0.2: 100 hits.
        tracker.record_at(&seen("127.0.0.2", &hit, 0, Path::Hit), now);
        // 127.0.0.3: an ndots cascade, 60 search-path NXDOMAINs (hits and misses) ...
        if i < 60 {
            let path = if i < 3 { Path::Miss } else { Path::Hit };
            tracker.record_at(&seen("127.0.0.3", &cascade[i % 3], 3, path), now);
        }
        // ... and 10 NXDOMAINs outside the cluster domain, from a block without cache.
        if i < 10 {
            tracker.record_at(&seen("127.0.0.3", &outside_nx, 3, Path::Uncached), now);
        }
        // 127.0.0.4: 40 refused; 127.0.0.5: 20 hits, the lightest of four: `other`.
        if i < 40 {
            tracker.record_at(&seen("127.0.0.4", &outside_nx, 5, Path::Local), now);
        }
        if i < 20 {
            tracker.record_at(&seen("127.0.0.5", &hit, 0, Path::Hit), now);
        }
    }
    let view = board.view(now);
    let rows: Vec<(IpAddr, Figures)> = view.clients.iter().map(|c| (c.addr, c.figures)).collect();
    assert_eq!(
        rows,
        [
            (
                ip("127.0.0.2"),
                Figures {
                    queries: 100,
                    hits: 100,
                    lookups: 100,
                    ..Figures::default()
                }
            ),
            (
                ip("127.0.0.3"),
                Figures {
                    queries: 70,
                    nxdomain: 70,
                    search_misses: 60,
                    hits: 57,
                    lookups: 60,
                    ..Figures::default()
                }
            ),
            (
                ip("127.0.0.4"),
                Figures {
                    queries: 40,
                    nxdomain: 0,
                    ..Figures::default()
                }
            ),
        ]
    );
    assert_eq!(
        view.other,
        Figures {
            queries: 20,
            hits: 20,
            lookups: 20,
            ..Figures::default()
        }
    );
    // Every query sampled (--clients-sample 1): the names are exact.
    assert_eq!(
        view.clients[1].names,
        [
            ("api.example.com.cluster.local.".to_owned(), 20),
            ("api.example.com.default.svc.cluster.local.".to_owned(), 20),
            ("api.example.com.svc.cluster.local.".to_owned(), 20),
            ("nothing.example.com.".to_owned(), 10),
        ]
    );
    let text = exposition(&board);
    for line in [
        "nodedns_client_queries_total{client=\"127.0.0.2\"} 100",
        "nodedns_client_queries_total{client=\"127.0.0.3\"} 70",
        "nodedns_client_queries_total{client=\"other\"} 20",
        "nodedns_client_search_path_nxdomain_total{client=\"127.0.0.3\"} 60",
        "nodedns_client_cache_hits_total{client=\"127.0.0.3\"} 57",
        "nodedns_client_name_queries_total{client=\"127.0.0.2\",name=\"kube-dns.kube-system.svc.cluster.local.\"} 100",
        "nodedns_client_alerts_total{signal=\"random_names\"} 0",
    ] {
        assert!(text.contains(line), "{line} missing from\n{text}");
    }
}

#[test]
fn a_flood_of_addresses_and_random_names_keeps_the_series_count_fixed() {
    let board = Arc::new(Board::new(args(10, 4)));
    let tracker = board.worker().unwrap();
    let now = Instant::now();
    let series = |text: &str| {
        text.lines()
            .filter(|l| l.starts_with("nodedns_client_"))
            .count()
    };
    let flood = |from: u32, to: u32| {
        for i in from..to {
            let client = IpAddr::V6(Ipv6Addr::from(0x2001_0db8_u128 << 96 | u128::from(i)));
            let qname = wire(&format!("r{i:08x}.example.com"));
            tracker.record_at(
                &Seen {
                    client,
                    qname: &qname,
                    rcode: 3,
                    path: Path::Miss,
                },
                now,
            );
        }
    };
    flood(0, 1_000);
    let first = series(&exposition(&board));
    flood(1_000, 50_000);
    let text = exposition(&board);
    // Names come and go with the sample; every other family has the same series.
    let fixed = |text: &str| {
        text.lines()
            .filter(|l| l.starts_with("nodedns_client_") && !l.contains("name_queries"))
            .count()
    };
    assert_eq!(fixed(&text), fixed(&exposition(&board)));
    // 7 counter families of 10 clients and `other`, a distinct gauge per client (the empty zone
    // for a client that lost its watch to another under the flood), three alert signals, and at
    // most the names panel's five names per client.
    assert_eq!(fixed(&text), 7 * 11 + 10 + 3, "{text}");
    assert!(first <= 7 * 11 + 10 + 3 + 10 * NAMES_PER_CLIENT, "{first}");
    assert!(series(&text) <= 7 * 11 + 10 + 3 + 10 * NAMES_PER_CLIENT);
    assert!(text.contains("nodedns_client_queries_total{client=\"other\"} 49990"));
}

#[test]
fn random_names_upstream_cross_the_threshold_once_a_minute() {
    let board = Board::new(Args {
        clients_alert_random: 5,
        clients_alert_distinct: 8,
        ..args(10, 16)
    });
    let tracker = board.worker().unwrap();
    let t0 = Instant::now();
    let names: Vec<Vec<u8>> = (0..20u64)
        .map(|i| {
            let label: String = (0..32)
                .map(|j| {
                    b"abcdefghijklmnopqrstuvwxyz234567"
                        [((i * 7919 + j * 104_729) ^ (j * j * 31)) as usize % 32]
                        as char
                })
                .collect();
            wire(&format!("{label}.t.example.com"))
        })
        .collect();
    for qname in &names {
        tracker.record_at(&seen("127.0.0.9", qname, 0, Path::Miss), t0);
    }
    let view = board.view(t0);
    let client = &view.clients[0];
    assert!(client.figures.random >= 18, "{:?}", client.figures);
    assert_eq!(
        view.alerts,
        [0, 1, 1],
        "once per minute each, however many more"
    );
    let (zone, per_minute) = client.zone.clone().unwrap();
    assert_eq!(zone, "t.example.com.");
    assert!((16..=24).contains(&per_minute), "{per_minute}");
    // The same names as hits are neither random (they did not go upstream) nor alerts.
    for qname in &names {
        tracker.record_at(&seen("127.0.0.9", qname, 0, Path::Hit), t0);
    }
    assert_eq!(
        board.view(t0).clients[0].figures.random,
        client.figures.random
    );
    // A minute later the client crosses again.
    let t1 = t0 + Duration::from_secs(61);
    for qname in &names {
        tracker.record_at(&seen("127.0.0.9", qname, 0, Path::Miss), t1);
    }
    assert_eq!(board.view(t1).alerts, [0, 2, 2]);
}

#[test]
fn long_queries_count_on_every_path_and_alert() {
    let board = Board::new(Args {
        clients_alert_long: 3,
        ..args(10, 16)
    });
    let tracker = board.worker().unwrap();
    let now = Instant::now();
    let long = wire(&format!("{}.example.com", "a".repeat(51)));
    let short = wire("www.example.com");
    for _ in 0..3 {
        tracker.record_at(&seen("127.0.0.2", &long, 0, Path::Hit), now);
        tracker.record_at(&seen("127.0.0.2", &short, 0, Path::Hit), now);
    }
    let view = board.view(now);
    assert_eq!(view.clients[0].figures.long, 3);
    assert_eq!(view.alerts, [1, 0, 0]);
}

#[test]
fn tracking_off_tracks_and_writes_nothing() {
    let board = Arc::new(Board::new(args(0, 1)));
    assert!(board.worker().is_none());
    assert!(!exposition(&board).contains("nodedns_client_"));
}

#[test]
fn an_nxdomain_under_the_cluster_domain_is_a_search_path_miss() {
    let board = Board::new(args(10, 1));
    assert_eq!(board.domain().as_deref(), Some("cluster.local."));
    let tracker = board.worker().unwrap();
    let now = Instant::now();
    for name in [
        "x.default.svc.cluster.local",
        "x.example.com",
        "cluster.local.example",
    ] {
        tracker.record_at(&seen("127.0.0.2", &wire(name), 3, Path::Hit), now);
    }
    let figures = board.view(now).clients[0].figures;
    assert_eq!((figures.nxdomain, figures.search_misses), (3, 1));
    let none = Board::new(Args {
        cluster_domain: None,
        ..args(10, 1)
    });
    assert_eq!(none.domain(), None);
    assert_eq!(
        super::domain("Cluster.Local").as_deref(),
        Ok("cluster.local.")
    );
    assert!(super::domain(".").is_err());
}

#[test]
fn an_address_is_its_ipv6_form_with_ipv4_mapped_and_back() {
    for text in [
        "10.244.1.17",
        "0.0.0.0",
        "255.255.255.255",
        "fd00::7",
        "::1",
    ] {
        let addr = ip(text);
        let v6 = match addr {
            IpAddr::V4(v4) => v4.to_ipv6_mapped(),
            IpAddr::V6(v6) => v6,
        };
        assert_eq!(key(addr), u128::from(v6), "{text}");
        assert_eq!(address(key(addr)), addr, "{text}");
    }
}
