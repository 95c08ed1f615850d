//! The link and its addresses, over rtnetlink.
//!
//! The link (default `nodelocaldns`, kind `dummy` like node-cache's) holds every local IP as a
//! host address (/32, /128) so that the kernel delivers packets for them locally. It is set up
//! (a down link keeps IPv6 addresses unusable) and IPv6 addresses carry `IFA_F_NODAD`: duplicate
//! address detection would keep them tentative, hence unbindable, for a second or more.

use std::net::IpAddr;

use futures_util::TryStreamExt;
use rtnetlink::packet_route::address::{AddressAttribute, AddressFlags, AddressMessage};
use rtnetlink::packet_route::link::{LinkAttribute, LinkFlags, LinkInfo, LinkMessage};
use rtnetlink::{LinkBridge, LinkDummy, LinkUnspec};

use crate::error::Error;
use crate::{LinkKind, Repair};

/// errno values the kernel answers with (Linux, all architectures we run on).
const ENODEV: i32 = 19;
const EEXIST: i32 = 17;
const EADDRNOTAVAIL: i32 = 99;
const EOPNOTSUPP: i32 = 95;

fn errno(error: &rtnetlink::Error) -> Option<i32> {
    match error {
        rtnetlink::Error::NetlinkError(message) => Some(-message.raw_code()),
        _ => None,
    }
}

/// A link as found.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Found {
    pub index: u32,
    /// `dummy`, `bridge`, ...; `None` for links without a kind (physical NICs).
    pub kind: Option<String>,
    pub up: bool,
}

impl Found {
    fn from_message(message: &LinkMessage) -> Found {
        let kind = message.attributes.iter().find_map(|attr| match attr {
            LinkAttribute::LinkInfo(infos) => infos.iter().find_map(|info| match info {
                LinkInfo::Kind(kind) => Some(kind.to_string()),
                _ => None,
            }),
            _ => None,
        });
        Found {
            index: message.header.index,
            kind,
            up: message.header.flags.contains(LinkFlags::Up),
        }
    }
}

/// An rtnetlink connection in the network namespace the process was in when it was opened.
pub(crate) struct Netlink {
    handle: rtnetlink::Handle,
}

impl std::fmt::Debug for Netlink {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Netlink").finish_non_exhaustive()
    }
}

impl Netlink {
    /// Opens the socket and spawns its driver task on the current tokio runtime.
    pub(crate) fn open() -> Result<Netlink, Error> {
        let (connection, handle, _) = rtnetlink::new_connection().map_err(Error::NetlinkOpen)?;
        tokio::spawn(connection);
        Ok(Netlink { handle })
    }

    pub(crate) async fn find(&self, name: &str) -> Result<Option<Found>, Error> {
        let mut replies = self.handle.link().get().match_name(name).execute();
        match replies.try_next().await {
            Ok(message) => Ok(message.as_ref().map(Found::from_message)),
            Err(e) if errno(&e) == Some(ENODEV) => Ok(None),
            Err(source) => Err(Error::LinkGet {
                name: name.to_owned(),
                source: Box::new(source),
            }),
        }
    }

    async fn create(&self, name: &str, kind: LinkKind) -> Result<(), Error> {
        let message = match kind {
            LinkKind::Dummy => LinkDummy::new(name).up().build(),
            LinkKind::Bridge => LinkBridge::new(name).up().build(),
        };
        match self.handle.link().add(message).execute().await {
            Ok(()) => Ok(()),
            Err(source) if errno(&source) == Some(EOPNOTSUPP) => Err(Error::LinkDriverMissing {
                name: name.to_owned(),
                kind: kind.as_str(),
                config: kind.kernel_config(),
                source: Box::new(source),
            }),
            Err(source) => Err(Error::LinkAdd {
                name: name.to_owned(),
                kind: kind.as_str(),
                source: Box::new(source),
            }),
        }
    }

    pub(crate) async fn delete(&self, name: &str, index: u32) -> Result<(), Error> {
        match self.handle.link().del(index).execute().await {
            Ok(()) => Ok(()),
            Err(e) if errno(&e) == Some(ENODEV) => Ok(()),
            Err(source) => Err(Error::LinkDelete {
                name: name.to_owned(),
                source: Box::new(source),
            }),
        }
    }

    async fn set_up(&self, name: &str, index: u32) -> Result<(), Error> {
        let message = LinkUnspec::new_with_index(index).up().build();
        self.handle
            .link()
            .set(message)
            .execute()
            .await
            .map_err(|source| Error::LinkUp {
                name: name.to_owned(),
                source: Box::new(source),
            })
    }

    /// The addresses on link `index`, with the messages needed to delete them.
    pub(crate) async fn addresses(
        &self,
        name: &str,
        index: u32,
    ) -> Result<Vec<(IpAddr, AddressMessage)>, Error> {
        let list_error = |source: rtnetlink::Error| Error::AddressList {
            name: name.to_owned(),
            source: Box::new(source),
        };
        let mut replies = self
            .handle
            .address()
            .get()
            .set_link_index_filter(index)
            .execute();
        let mut out = Vec::new();
        while let Some(message) = replies.try_next().await.map_err(list_error)? {
            // The kernel filters by index only for strict-checking sockets: filter again.
            if message.header.index != index {
                continue;
            }
            let local = message.attributes.iter().find_map(|a| match a {
                AddressAttribute::Local(ip) => Some(*ip),
                _ => None,
            });
            let address = message.attributes.iter().find_map(|a| match a {
                AddressAttribute::Address(ip) => Some(*ip),
                _ => None,
            });
            if let Some(ip) = local.or(address) {
                out.push((ip, message));
            }
        }
        Ok(out)
    }

    async fn add_address(&self, name: &str, index: u32, ip: IpAddr) -> Result<(), Error> {
        let prefix = if ip.is_ipv4() { 32 } else { 128 };
        let mut request = self.handle.address().add(index, ip, prefix);
        if ip.is_ipv6() {
            request
                .message_mut()
                .attributes
                .push(AddressAttribute::Flags(AddressFlags::Nodad));
        }
        match request.execute().await {
            Ok(()) => Ok(()),
            Err(e) if errno(&e) == Some(EEXIST) => Ok(()),
            Err(source) => Err(Error::AddressAdd {
                name: name.to_owned(),
                ip,
                source: Box::new(source),
            }),
        }
    }

    async fn delete_address(
        &self,
        name: &str,
        ip: IpAddr,
        message: AddressMessage,
    ) -> Result<(), Error> {
        match self.handle.address().del(message).execute().await {
            Ok(()) => Ok(()),
            Err(e) if errno(&e) == Some(EADDRNOTAVAIL) => Ok(()),
            Err(source) => Err(Error::AddressDelete {
                name: name.to_owned(),
                ip,
                source: Box::new(source),
            }),
        }
    }

    /// Makes link `name` exist, of `kind`, up, holding exactly `ips` (plus the IPv6 link-local
    /// address the kernel gives every up link). Tells `made` each change as soon as the kernel
    /// has made it.
    pub(crate) async fn ensure(
        &self,
        name: &str,
        kind: LinkKind,
        ips: &[IpAddr],
        made: &mut impl FnMut(Repair),
    ) -> Result<(), Error> {
        let mut found = self.find(name).await?;
        if let Some(link) = &found {
            match link.kind.as_deref() {
                Some(k) if k == kind.as_str() => {}
                // A link of ours from a run with another --link-kind: replace it.
                Some(k) if LinkKind::ALL.iter().any(|known| known.as_str() == k) => {
                    tracing::info!(link = name, from = k, to = kind.as_str(), "replacing link");
                    self.delete(name, link.index).await?;
                    found = None;
                }
                other => {
                    return Err(Error::LinkForeign {
                        name: name.to_owned(),
                        found: other.unwrap_or("none").to_owned(),
                    });
                }
            }
        }
        let link = match found {
            Some(link) => link,
            None => {
                self.create(name, kind).await?;
                made(Repair::Link);
                self.find(name).await?.ok_or_else(|| Error::LinkGet {
                    name: name.to_owned(),
                    source: Box::new(rtnetlink::Error::RequestFailed),
                })?
            }
        };
        if !link.up {
            self.set_up(name, link.index).await?;
            made(Repair::LinkUp);
        }
        let present = self.addresses(name, link.index).await?;
        for &ip in ips {
            if !present.iter().any(|(p, _)| *p == ip) {
                self.add_address(name, link.index, ip).await?;
                made(Repair::AddressAdded(ip));
            }
        }
        for (ip, message) in present {
            if ips.contains(&ip) || is_kernel_link_local(ip) {
                continue;
            }
            self.delete_address(name, ip, message).await?;
            made(Repair::AddressRemoved(ip));
        }
        Ok(())
    }
}

/// The fe80::/64 address the kernel adds to every link that comes up: not ours to remove.
fn is_kernel_link_local(ip: IpAddr) -> bool {
    matches!(ip, IpAddr::V6(v6) if (v6.segments()[0] & 0xffc0) == 0xfe80)
}

impl LinkKind {
    pub(crate) const ALL: [LinkKind; 2] = [LinkKind::Dummy, LinkKind::Bridge];

    fn kernel_config(self) -> &'static str {
        match self {
            LinkKind::Dummy => "CONFIG_DUMMY",
            LinkKind::Bridge => "CONFIG_BRIDGE",
        }
    }
}
