//! The listening sockets of one instance, whether bound here or received from another instance,
//! and a [`Generation`]: the workers and tasks serving them, which can be stopped (after a
//! hand-over) and started again on the same sockets (after a take-back).

use std::collections::BTreeMap;
use std::io;
use std::net::SocketAddr;
use std::os::fd::{AsFd, BorrowedFd, OwnedFd};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};

use socket2::{SockRef, Type};
use tokio::sync::watch;

use crate::admin;
use crate::serve::{Endpoint, Shared, https, tcp, udp};

/// What a listening socket serves.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Kind {
    /// DNS over UDP: one socket per worker, all in the address's `SO_REUSEPORT` group.
    Udp,
    /// DNS over TCP: one listener per address.
    Tcp,
    /// DNS over TLS: one listener per address.
    Tls,
    /// DNS over HTTPS (or cleartext HTTP): one listener per address.
    Https,
    /// `/health`, `/ready`, `/metrics`.
    Admin,
}

impl Kind {
    pub(super) fn name(self) -> &'static str {
        match self {
            Kind::Udp => "udp",
            Kind::Tcp => "tcp",
            Kind::Tls => "tls",
            Kind::Https => "https",
            Kind::Admin => "admin",
        }
    }

    pub(super) fn from_name(name: &str) -> Option<Kind> {
        match name {
            "udp" => Some(Kind::Udp),
            "tcp" => Some(Kind::Tcp),
            "tls" => Some(Kind::Tls),
            "https" => Some(Kind::Https),
            "admin" => Some(Kind::Admin),
            _ => None,
        }
    }

    fn socket_type(self) -> Type {
        match self {
            Kind::Udp => Type::DGRAM,
            Kind::Tcp | Kind::Tls | Kind::Https | Kind::Admin => Type::STREAM,
        }
    }
}

/// Why the listening sockets could not be opened or served.
#[derive(Debug, thiserror::Error)]
pub enum ListenError {
    /// Binding an address (a bind refused by another socket's owner says why:
    /// [`crate::serve::sibling::in_use`]).
    #[error("bind {kind} {addr}")]
    Bind {
        kind: &'static str,
        addr: SocketAddr,
        #[source]
        source: io::Error,
    },
    /// A step of starting to serve a bound socket: duplicating its descriptor, registering it
    /// with the runtime, spawning its worker.
    #[error("{step}")]
    Serve {
        step: &'static str,
        #[source]
        source: io::Error,
    },
}

impl ListenError {
    fn bind(kind: &'static str, addr: SocketAddr) -> impl FnOnce(io::Error) -> ListenError {
        move |source| ListenError::Bind { kind, addr, source }
    }

    fn serve(step: &'static str) -> impl FnOnce(io::Error) -> ListenError {
        move |source| ListenError::Serve { step, source }
    }
}

/// One listening socket.
#[derive(Debug)]
pub struct Socket {
    pub kind: Kind,
    pub addr: SocketAddr,
    pub fd: OwnedFd,
}

impl Socket {
    /// Checks a socket received from another instance: it must be of the kind and bound to the
    /// address the message said. A descriptor that is not is closed, never served.
    pub fn received(kind: Kind, addr: SocketAddr, fd: OwnedFd) -> io::Result<Socket> {
        let sock = SockRef::from(&fd);
        let actual_type = sock.r#type()?;
        let actual_addr = sock.local_addr()?.as_socket();
        if actual_type != kind.socket_type() || actual_addr != Some(addr) {
            return Err(io::Error::new(
                io::ErrorKind::InvalidData,
                format!(
                    "received {} {addr} is a {actual_type:?} socket bound to {actual_addr:?}",
                    kind.name()
                ),
            ));
        }
        if kind != Kind::Udp && !sock.is_listener()? {
            return Err(io::Error::new(
                io::ErrorKind::InvalidData,
                format!("received {} {addr} is not listening", kind.name()),
            ));
        }
        Ok(Socket { kind, addr, fd })
    }

    pub fn as_fd(&self) -> BorrowedFd<'_> {
        self.fd.as_fd()
    }
}

/// Every listening socket of an instance.
#[derive(Debug, Default)]
pub struct Listeners {
    sockets: Vec<Socket>,
    /// What each admin address serves (this instance's configuration decides, whoever bound
    /// the socket).
    admin: BTreeMap<SocketAddr, admin::Roles>,
    /// How each DNS address is served (its TLS configuration, as this instance loaded it).
    dns: BTreeMap<SocketAddr, Endpoint>,
}

/// The kinds of socket an endpoint is served on.
fn kinds(endpoint: &Endpoint) -> &'static [Kind] {
    match endpoint {
        Endpoint::Dns => &[Kind::Udp, Kind::Tcp],
        Endpoint::Tcp => &[Kind::Tcp],
        Endpoint::Tls(_) => &[Kind::Tls],
        Endpoint::Https(_) => &[Kind::Https],
    }
}

/// How [`Listeners::open`] came by its sockets (for the log).
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub struct Opened {
    /// Received from another instance and served.
    pub inherited: usize,
    /// Bound here (no instance had them).
    pub bound: usize,
    /// Received but not served: their address is not in this instance's configuration.
    pub unused: usize,
}

impl Listeners {
    /// The sockets for `dns` and `admin` addresses (each with what it serves): those `inherited` from another instance
    /// where it had them (every UDP socket it had for an address, whatever `threads` says: the
    /// queries queued on each must be read), the rest bound here (`threads` UDP sockets per
    /// address). Binding everything before serving anything, so a bad address fails start-up
    /// whole.
    pub fn open(
        dns: &BTreeMap<SocketAddr, Endpoint>,
        admin: &BTreeMap<SocketAddr, admin::Roles>,
        threads: usize,
        inherited: Vec<Socket>,
    ) -> Result<(Listeners, Opened), ListenError> {
        let mut opened = Opened::default();
        let mut sockets = Vec::new();
        let wanted = |s: &Socket| match s.kind {
            Kind::Udp | Kind::Tcp | Kind::Tls | Kind::Https => dns
                .get(&s.addr)
                .is_some_and(|endpoint| kinds(endpoint).contains(&s.kind)),
            Kind::Admin => admin.contains_key(&s.addr),
        };
        for socket in inherited {
            if wanted(&socket) {
                opened.inherited += 1;
                sockets.push(socket);
            } else {
                opened.unused += 1;
            }
        }
        let has = |sockets: &[Socket], kind: Kind, addr: SocketAddr| {
            sockets.iter().any(|s| s.kind == kind && s.addr == addr)
        };
        let mut bound = Vec::new();
        for (&addr, endpoint) in dns {
            for &kind in kinds(endpoint) {
                if has(&sockets, kind, addr) {
                    continue;
                }
                if kind == Kind::Udp {
                    for _ in 0..threads.max(1) {
                        let socket = udp::bind(addr).map_err(ListenError::bind("UDP", addr))?;
                        bound.push(Socket {
                            kind: Kind::Udp,
                            addr,
                            fd: socket.into(),
                        });
                    }
                    continue;
                }
                let what = match kind {
                    Kind::Tls => "TLS",
                    Kind::Https => "HTTPS",
                    _ => "TCP",
                };
                let listener = tcp::bind(addr).map_err(ListenError::bind(what, addr))?;
                bound.push(Socket {
                    kind,
                    addr,
                    fd: listener
                        .into_std()
                        .map_err(ListenError::serve("TCP listener"))?
                        .into(),
                });
            }
        }
        for &addr in admin.keys() {
            if !has(&sockets, Kind::Admin, addr) {
                let listener = admin::bind(addr).map_err(ListenError::bind("admin", addr))?;
                bound.push(Socket {
                    kind: Kind::Admin,
                    addr,
                    fd: listener
                        .into_std()
                        .map_err(ListenError::serve("admin listener"))?
                        .into(),
                });
            }
        }
        opened.bound = bound.len();
        sockets.extend(bound);
        let admin = admin.clone();
        let dns = dns.clone();
        Ok((
            Listeners {
                sockets,
                admin,
                dns,
            },
            opened,
        ))
    }

    pub fn sockets(&self) -> &[Socket] {
        &self.sockets
    }

    /// The same sockets under new descriptors (`dup`): kept while another instance serves them,
    /// so that they can be served again if it goes away.
    pub fn try_clone(&self) -> Result<Listeners, ListenError> {
        let sockets = self
            .sockets
            .iter()
            .map(|s| {
                Ok(Socket {
                    kind: s.kind,
                    addr: s.addr,
                    fd: s.fd.try_clone()?,
                })
            })
            .collect::<io::Result<_>>()
            .map_err(ListenError::serve("duplicate the listening sockets"))?;
        Ok(Listeners {
            sockets,
            admin: self.admin.clone(),
            dns: self.dns.clone(),
        })
    }

    /// Hands the sockets out, for serving them again after a take-back.
    pub fn into_sockets(self) -> Vec<Socket> {
        self.sockets
    }
}

/// What serves a [`Listeners`]: a UDP worker thread per UDP socket, an accept task per TCP and
/// admin listener. Connections already accepted are not part of it: they live on until their
/// client closes them or they idle out, also after [`Generation::stop`].
#[derive(Debug)]
pub struct Generation {
    stop: watch::Sender<bool>,
    udp_stop: Arc<AtomicBool>,
    udp_threads: Vec<std::thread::JoinHandle<()>>,
    tasks: Vec<tokio::task::JoinHandle<()>>,
}

impl Generation {
    /// Starts serving every socket of `listeners` (through duplicated descriptors, so the
    /// listeners stay usable after [`Generation::stop`]). Must run inside the tokio runtime.
    pub fn spawn<S: admin::Source>(
        listeners: &Listeners,
        shared: &Arc<Shared>,
        admin_source: &Arc<S>,
        limits: tcp::Limits,
        connections: &Arc<tcp::Connections>,
    ) -> Result<Generation, ListenError> {
        let (stop, stopped) = watch::channel(false);
        let udp_stop = Arc::new(AtomicBool::new(false));
        let mut generation = Generation {
            stop,
            udp_stop,
            udp_threads: Vec::new(),
            tasks: Vec::new(),
        };
        let mut workers = 0usize;
        for socket in &listeners.sockets {
            let fd = socket
                .fd
                .try_clone()
                .map_err(ListenError::serve("duplicate a listening socket"))?;
            let addr = socket.addr;
            match socket.kind {
                Kind::Udp => {
                    let socket = Arc::new(std::net::UdpSocket::from(fd));
                    let shared = shared.clone();
                    let stop = udp::Stop {
                        flag: generation.udp_stop.clone(),
                        signal: stopped.clone(),
                    };
                    let thread = std::thread::Builder::new()
                        .name(format!("udp-{workers}"))
                        .spawn(move || udp::run(shared, socket, addr, stop))
                        .map_err(ListenError::serve("spawn UDP worker"))?;
                    workers += 1;
                    generation.udp_threads.push(thread);
                }
                Kind::Tcp | Kind::Tls => {
                    let listener = tokio::net::TcpListener::from_std(fd.into())
                        .map_err(ListenError::serve("register TCP listener"))?;
                    let tls = match listeners.dns.get(&addr) {
                        Some(Endpoint::Tls(tls)) if socket.kind == Kind::Tls => Some(tls.clone()),
                        _ => None,
                    };
                    generation.tasks.push(tokio::spawn(tcp::run(
                        shared.clone(),
                        listener,
                        addr,
                        limits,
                        connections.clone(),
                        stopped.clone(),
                        tls,
                    )));
                }
                Kind::Https => {
                    let listener = tokio::net::TcpListener::from_std(fd.into())
                        .map_err(ListenError::serve("register HTTPS listener"))?;
                    let tls = match listeners.dns.get(&addr) {
                        Some(Endpoint::Https(tls)) => tls.clone(),
                        _ => None,
                    };
                    generation.tasks.push(tokio::spawn(https::run(
                        shared.clone(),
                        listener,
                        addr,
                        limits,
                        connections.clone(),
                        stopped.clone(),
                        tls,
                    )));
                }
                Kind::Admin => {
                    let listener = tokio::net::TcpListener::from_std(fd.into())
                        .map_err(ListenError::serve("register admin listener"))?;
                    let roles = listeners.admin.get(&addr).copied().unwrap_or_default();
                    generation.tasks.push(tokio::spawn(admin::serve(
                        listener,
                        roles,
                        admin_source.clone(),
                        stopped.clone(),
                    )));
                }
            }
        }
        Ok(generation)
    }

    /// Stops reading: UDP workers answer the batch they read and return, accept loops return.
    /// The sockets stay open (in [`Listeners`], and in the instance that now serves them), so
    /// nothing queued on them is lost.
    pub async fn stop(self) {
        self.udp_stop.store(true, Ordering::Release);
        let _ = self.stop.send(true);
        for task in self.tasks {
            let _ = task.await;
        }
        let threads = self.udp_threads;
        let _ = tokio::task::spawn_blocking(move || {
            for thread in threads {
                let _ = thread.join();
            }
        })
        .await;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    use crate::handoff::tests::free_addr as loopback;

    #[tokio::test]
    async fn open_binds_threads_udp_sockets_a_tcp_and_an_admin_listener() {
        let (dns, admin) = (loopback(), loopback());
        let (listeners, opened) = Listeners::open(
            &[(dns, Endpoint::Dns)].into(),
            &[(admin, admin::Roles::default())].into(),
            3,
            Vec::new(),
        )
        .unwrap();
        assert_eq!(
            opened,
            Opened {
                inherited: 0,
                bound: 5,
                unused: 0
            }
        );
        let kinds: Vec<_> = listeners
            .sockets()
            .iter()
            .map(|s| (s.kind, s.addr))
            .collect();
        assert_eq!(
            kinds,
            [
                (Kind::Udp, dns),
                (Kind::Udp, dns),
                (Kind::Udp, dns),
                (Kind::Tcp, dns),
                (Kind::Admin, admin)
            ]
        );
    }

    #[tokio::test]
    async fn tls_and_https_addresses_get_one_listener_of_their_kind_and_keep_it_across_a_hand_over()
    {
        let (dot, tcp_only, doh) = (loopback(), loopback(), loopback());
        let endpoints: BTreeMap<SocketAddr, Endpoint> = [
            (dot, Endpoint::Tls(test_tls())),
            (tcp_only, Endpoint::Tcp),
            (doh, Endpoint::Https(None)),
        ]
        .into();
        let (old, opened) = Listeners::open(&endpoints, &BTreeMap::new(), 4, Vec::new()).unwrap();
        assert_eq!(opened.bound, 3, "one listener each, no UDP socket");
        // In address order (the map's).
        let mut kinds: Vec<_> = old.sockets().iter().map(|s| (s.kind, s.addr)).collect();
        kinds.sort_by_key(|(_, addr)| *addr);
        let mut expected = [(Kind::Tls, dot), (Kind::Tcp, tcp_only), (Kind::Https, doh)];
        expected.sort_by_key(|(_, addr)| *addr);
        assert_eq!(kinds, expected);
        // Received by the next instance under their kinds' names, they are served as they are.
        let received: Vec<Socket> = old
            .try_clone()
            .unwrap()
            .into_sockets()
            .into_iter()
            .map(|s| Socket::received(Kind::from_name(s.kind.name()).unwrap(), s.addr, s.fd))
            .collect::<io::Result<_>>()
            .unwrap();
        let (new, opened) = Listeners::open(&endpoints, &BTreeMap::new(), 4, received).unwrap();
        assert_eq!((opened.inherited, opened.bound, opened.unused), (3, 0, 0));
        assert_eq!(new.sockets().len(), 3);
        // An address whose transport changed keeps none of the old sockets: a plain TCP
        // listener is not served as TLS.
        let changed: BTreeMap<SocketAddr, Endpoint> =
            [(tcp_only, Endpoint::Tls(test_tls()))].into();
        let inherited = new.try_clone().unwrap().into_sockets();
        let inherited: Vec<Socket> = inherited
            .into_iter()
            .filter(|s| s.addr == tcp_only)
            .collect();
        drop((old, new));
        let (changed, opened) = Listeners::open(&changed, &BTreeMap::new(), 4, inherited).unwrap();
        assert_eq!((opened.inherited, opened.bound, opened.unused), (0, 1, 1));
        assert_eq!(changed.sockets()[0].kind, Kind::Tls);
    }

    /// A TLS configuration (its certificate is never presented here).
    fn test_tls() -> Arc<rustls::ServerConfig> {
        let key = rcgen::KeyPair::generate().unwrap();
        let cert = rcgen::CertificateParams::new(vec!["dns.test".to_owned()])
            .unwrap()
            .self_signed(&key)
            .unwrap();
        let config = rustls::ServerConfig::builder_with_provider(Arc::new(
            rustls::crypto::ring::default_provider(),
        ))
        .with_safe_default_protocol_versions()
        .unwrap()
        .with_no_client_auth()
        .with_single_cert(
            vec![cert.der().clone()],
            rustls::pki_types::PrivateKeyDer::Pkcs8(key.serialize_der().into()),
        )
        .unwrap();
        Arc::new(config)
    }

    #[tokio::test]
    async fn inherited_sockets_are_served_as_they_are_and_unwanted_ones_are_dropped() {
        let (dns, gone) = (loopback(), loopback());
        let (old, _) = Listeners::open(
            &[(dns, Endpoint::Dns), (gone, Endpoint::Dns)].into(),
            &BTreeMap::new(),
            2,
            Vec::new(),
        )
        .unwrap();
        let inherited = old.try_clone().unwrap().into_sockets();
        // The new instance wants more workers, and no longer serves `gone`.
        let (new, opened) = Listeners::open(
            &[(dns, Endpoint::Dns)].into(),
            &BTreeMap::new(),
            8,
            inherited,
        )
        .unwrap();
        assert_eq!(
            opened,
            Opened {
                inherited: 3,
                bound: 0,
                unused: 3
            }
        );
        assert!(new.sockets().iter().all(|s| s.addr == dns));
        assert_eq!(
            new.sockets().iter().filter(|s| s.kind == Kind::Udp).count(),
            2
        );
    }

    #[tokio::test]
    async fn a_received_descriptor_must_be_what_the_message_says() {
        let addr = loopback();
        let udp = std::net::UdpSocket::bind(addr).unwrap();
        let tcp = std::net::TcpListener::bind(addr).unwrap();
        let other = loopback();
        assert!(Socket::received(Kind::Udp, addr, udp.try_clone().unwrap().into()).is_ok());
        assert!(Socket::received(Kind::Tcp, addr, tcp.try_clone().unwrap().into()).is_ok());
        assert!(Socket::received(Kind::Tcp, addr, udp.try_clone().unwrap().into()).is_err());
        assert!(Socket::received(Kind::Udp, other, udp.into()).is_err());
        // A connected stream is not a listener.
        let stream = std::net::TcpStream::connect(addr).unwrap();
        assert!(
            Socket::received(Kind::Admin, stream.local_addr().unwrap(), stream.into()).is_err()
        );
    }
}
