//! Walking names in wire form (RFC 1035 §3.1, §4.1.4), shared by the query and reply parsers.
