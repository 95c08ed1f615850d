//! What a query carries through the pipeline: who asked, over what, its labels, and at the end
//! what answered it.

use std::net::SocketAddr;

use nodedns_cache::Class;

use crate::clients::Path;
use crate::metrics::{CacheUse, Plugin, Series, Transport};

/// Largest query accepted, over either transport. Queries are small (one question, maybe an OPT
/// with a cookie or padding); a UDP datagram longer than this is cut by the kernel and then fails
/// to parse, and a TCP frame announcing more closes its connection (so no client makes a read
/// buffer grow past it).
pub const MAX_QUERY: usize = 2048;

/// Transport of a client query.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Proto {
    Udp,
    Tcp,
}

impl Proto {
    pub fn as_str(self) -> &'static str {
        self.transport().as_str()
    }

    /// The `proto` label.
    #[inline]
    pub fn transport(self) -> Transport {
        match self {
            Proto::Udp => Transport::Udp,
            Proto::Tcp => Transport::Tcp,
        }
    }
}

/// Who asked a query: the transport it came over and the client's address.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Client {
    pub proto: Proto,
    pub addr: SocketAddr,
}

/// What one query is counted and logged as, decided when it is routed. `Copy`, so a query that
/// goes upstream carries them to the task that answers it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Labels {
    /// Its metric series (listen address, zone).
    pub series: Series,
    /// Its block has a cache: hits and misses count, answers are the cache plugin's.
    pub cache: bool,
    /// Its block logs its queries (`log`, or `--query-log`).
    pub log: bool,
}

/// What answered a query, and how it went through its block's cache.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Source {
    /// A fresh cache entry, without going upstream (a hit).
    Hit(Class),
    /// An expired entry, at once, because the upstream is known to be down (RFC 8767 §5): a hit,
    /// served stale.
    StaleHit(Class),
    /// The upstream's reply, after a cache miss (or in a block without cache).
    Upstream,
    /// A fresh cache entry after a miss whose fetch failed: another fetch stored it meanwhile.
    FreshAfterMiss(Class),
    /// An expired entry after the upstream failed (RFC 8767 §4): a miss, served stale.
    StaleAfterMiss,
    /// SERVFAIL made by nodedns: the upstream failed and nothing stale was left.
    ServFail,
    /// REFUSED made by nodedns: no block serves the name.
    Refused,
    /// A plugin after the cache answered (`hosts`, `whoami`), after a miss.
    Plugin(Plugin),
    /// SERVFAIL a plugin after the cache gave (`hosts` without `fallthrough` for an unknown
    /// name), never cached.
    PluginServFail,
    /// SERVFAIL at the end of the block's chain: no plugin took the query (its `forward` does
    /// not take the name and nothing else answered), as CoreDNS's `NextOrFailure`.
    Unhandled,
    /// `dns64`'s AAAA answer, made from the A answer (before the cache, so never stored); the
    /// class of the AAAA entry when the AAAA answer was a hit.
    Dns64(Option<Class>),
}

impl Source {
    /// The `plugin` label of the response ([`Plugin`] says how CoreDNS picks it): in a block
    /// with `cache` every answer but nodedns's own errors passed the cache's writer.
    #[inline]
    pub fn plugin(self, cache: bool) -> Plugin {
        match self {
            Source::Hit(_)
            | Source::StaleHit(_)
            | Source::FreshAfterMiss(_)
            | Source::StaleAfterMiss => Plugin::Cache,
            Source::Upstream | Source::Plugin(_) if cache => Plugin::Cache,
            Source::Upstream => Plugin::Forward,
            Source::Plugin(plugin) => plugin,
            Source::ServFail | Source::Refused | Source::PluginServFail | Source::Unhandled => {
                Plugin::None
            }
            Source::Dns64(_) => Plugin::Dns64,
        }
    }

    /// How the cache of a block with (`cache`) or without one took part.
    #[inline]
    pub fn cache_use(self, cache: bool) -> CacheUse {
        if !cache {
            return CacheUse::Bypassed;
        }
        match self {
            Source::Hit(class) => CacheUse::Hit(class),
            Source::StaleHit(class) => CacheUse::StaleHit(class),
            Source::Upstream
            | Source::FreshAfterMiss(_)
            | Source::ServFail
            | Source::Plugin(_)
            | Source::PluginServFail
            | Source::Unhandled => CacheUse::Miss,
            Source::StaleAfterMiss => CacheUse::StaleMiss,
            Source::Refused => CacheUse::Bypassed,
            // How the AAAA question went through the cache (the A look-up is not counted).
            Source::Dns64(Some(class)) => CacheUse::Hit(class),
            Source::Dns64(None) => CacheUse::Miss,
        }
    }

    /// How the query went through a block with (`cache`) or without a cache, for its client's
    /// figures.
    #[inline]
    pub fn path(self, cache: bool) -> Path {
        match self {
            Source::Hit(_) | Source::StaleHit(_) | Source::Dns64(Some(_)) => Path::Hit,
            Source::Dns64(None) if cache => Path::Miss,
            Source::Dns64(None) => Path::Uncached,
            Source::Upstream
            | Source::FreshAfterMiss(_)
            | Source::StaleAfterMiss
            | Source::ServFail
                if cache =>
            {
                Path::Miss
            }
            Source::Upstream
            | Source::FreshAfterMiss(_)
            | Source::StaleAfterMiss
            | Source::ServFail => Path::Uncached,
            // Nothing went upstream: nodedns's REFUSED, a plugin's answer, the end of the chain.
            Source::Refused | Source::Plugin(_) | Source::PluginServFail | Source::Unhandled => {
                Path::Local
            }
        }
    }

    /// For the query log.
    pub fn as_str(self) -> &'static str {
        match self {
            Source::Hit(_) => "cache",
            Source::StaleHit(_) => "cache-stale",
            Source::Upstream => "upstream",
            Source::FreshAfterMiss(_) => "upstream-failed-cache",
            Source::StaleAfterMiss => "upstream-failed-stale",
            Source::ServFail => "servfail",
            Source::Refused => "refused",
            Source::Plugin(Plugin::Hosts) => "hosts",
            Source::Plugin(Plugin::Whoami) => "whoami",
            Source::Plugin(Plugin::Template) => "template",
            Source::Plugin(_) => "plugin",
            Source::PluginServFail => "plugin-servfail",
            Source::Unhandled => "no-plugin",
            Source::Dns64(_) => "dns64",
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn answers_count_as_coredns_counts_them() {
        use CacheUse::{Bypassed, Hit, Miss, StaleHit, StaleMiss};
        let s = Class::Success;
        for (source, plugin, cached) in [
            (Source::Hit(s), Plugin::Cache, Hit(s)),
            (Source::StaleHit(s), Plugin::Cache, StaleHit(s)),
            (Source::Upstream, Plugin::Cache, Miss),
            (Source::FreshAfterMiss(s), Plugin::Cache, Miss),
            (Source::StaleAfterMiss, Plugin::Cache, StaleMiss),
            (Source::ServFail, Plugin::None, Miss),
            (Source::Refused, Plugin::None, Bypassed),
            (Source::Plugin(Plugin::Hosts), Plugin::Cache, Miss),
            (Source::PluginServFail, Plugin::None, Miss),
            (Source::Unhandled, Plugin::None, Miss),
        ] {
            assert_eq!(source.plugin(true), plugin, "{source:?}");
            assert_eq!(source.cache_use(true), cached, "{source:?}");
            assert_eq!(source.cache_use(false), Bypassed, "{source:?}");
        }
        assert_eq!(Source::Upstream.plugin(false), Plugin::Forward);
        assert_eq!(Source::StaleHit(s).path(true), Path::Hit);
        assert_eq!(Source::FreshAfterMiss(s).path(true), Path::Miss);
        assert_eq!(Source::ServFail.path(false), Path::Uncached);
        assert_eq!(Source::Refused.path(true), Path::Local);
        assert_eq!(Source::ServFail.plugin(false), Plugin::None);
        assert_eq!(Source::Plugin(Plugin::Hosts).plugin(false), Plugin::Hosts);
        assert_eq!(Source::Dns64(Some(s)).plugin(true), Plugin::Dns64);
        assert_eq!(Source::Dns64(Some(s)).cache_use(true), Hit(s));
        assert_eq!(Source::Dns64(None).cache_use(true), Miss);
        assert_eq!(Source::Dns64(None).path(false), Path::Uncached);
    }
}
