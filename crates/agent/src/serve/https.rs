//! DNS over HTTPS (RFC 8484) for `https://` blocks: `GET /dns-query?dns=BASE64URL` and
//! `POST /dns-query` with an `application/dns-message` body, each answered through the same
//! pipeline as a query over TCP (cache, plugins, forward; counted under the `tcp` proto label, as
//! CoreDNS counts them), as `application/dns-message` with `Cache-Control: max-age` the answer's
//! smallest TTL (CoreDNS's `dnsutil.MinimalTTL`).
//!
//! With the block's `tls` directive the listener speaks TLS, offering HTTP/2 and HTTP/1.1 by
//! ALPN; without it, as CoreDNS does, cleartext HTTP/1.1.
//!
//! Bounds, so that a hostile client cannot exhaust memory or descriptors:
//! - connections count against the same caps as DNS over TCP ([`tcp::Connections`]): in all and
//!   per client address;
//! - a request head must arrive within the idle timeout (also between requests), and a TLS
//!   handshake within it too; a response write that makes no progress for the write timeout
//!   ends the connection;
//! - a head is read into at most [`MAX_HEAD`] bytes, a body of more than [`MAX_BODY`] bytes is
//!   refused (413) without being read further;
//! - HTTP/2: at most [`tcp::Limits::max_in_flight`] streams at once per connection.

use std::convert::Infallible;
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Instant;

use http_body_util::{BodyExt, Full, LengthLimitError, Limited};
use hyper::body::{Body, Bytes, Incoming};
use hyper::header::{self, HeaderMap, HeaderValue};
use hyper::{Method, Request, Response, StatusCode, Uri};
use hyper_util::rt::{TokioExecutor, TokioIo, TokioTimer};
use tokio::io::{AsyncRead, AsyncWrite};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::{oneshot, watch};

use super::Shared;
use super::pipeline::{self, Front, Recorder, ReplyTo};
use super::request::{Client, Proto};
use super::tcp;
use crate::admin::Stalls;

/// The endpoint's path (CoreDNS serves only this one).
pub const PATH: &str = "/dns-query";
/// Largest request body accepted (RFC 8484 §6: a DNS message is at most 65535 bytes).
pub const MAX_BODY: usize = 65535;
/// Bytes hyper buffers for a request head at most (HTTP/1.1), and the largest header list
/// (HTTP/2).
pub const MAX_HEAD: usize = 16 << 10;
/// The media type of a DNS message (RFC 8484 §6).
pub const DNS_MESSAGE: &str = "application/dns-message";
/// `Cache-Control: max-age` of answers without records to take it from, and of failures
/// (CoreDNS's `MinimalDefaultTTL`).
const DEFAULT_MAX_AGE: u32 = 5;
/// The largest `max-age` given (CoreDNS's `MaximumDefaulTTL`).
const MAX_MAX_AGE: u32 = 3600;

/// Accepts connections on `listener` until `stop` turns true; TLS first when `tls` is given.
pub async fn run(
    shared: Arc<Shared>,
    listener: TcpListener,
    local: SocketAddr,
    limits: tcp::Limits,
    connections: Arc<tcp::Connections>,
    stop: watch::Receiver<bool>,
    tls: Option<Arc<rustls::ServerConfig>>,
) {
    let each = |stream: TcpStream, peer: SocketAddr, admitted| {
        let tls = tcp::current_tls(&shared, local, tls.as_ref());
        let context = Arc::new(Context {
            shared: shared.clone(),
            local,
            peer,
        });
        tokio::spawn(async move {
            let _admitted = admitted;
            connection(context, stream, limits, tls).await;
        });
    };
    tcp::accept_each(
        "DNS over HTTPS",
        &shared,
        &listener,
        local,
        &connections,
        stop,
        each,
    )
    .await;
}

/// What a connection's requests are answered with.
#[derive(Debug)]
struct Context {
    shared: Arc<Shared>,
    local: SocketAddr,
    peer: SocketAddr,
}

async fn connection(
    context: Arc<Context>,
    stream: TcpStream,
    limits: tcp::Limits,
    tls: Option<Arc<rustls::ServerConfig>>,
) {
    tcp::tune(&stream);
    let peer = context.peer;
    let Some(tls) = tls else {
        serve_http1(context, stream, limits).await;
        return;
    };
    let Some(stream) = tcp::handshake(stream, tls, limits.idle_timeout, peer).await else {
        return;
    };
    if stream.get_ref().1.alpn_protocol() == Some(b"h2") {
        serve_http2(context, stream, limits).await;
    } else {
        serve_http1(context, stream, limits).await;
    }
}

fn service(
    context: Arc<Context>,
) -> impl hyper::service::Service<
    Request<Incoming>,
    Response = Response<Full<Bytes>>,
    Error = Infallible,
    Future = impl Future<Output = Result<Response<Full<Bytes>>, Infallible>> + Send,
> + Clone {
    hyper::service::service_fn(move |req| {
        let context = context.clone();
        async move { Ok::<_, Infallible>(handle(&context, req).await) }
    })
}

async fn serve_http1<S>(context: Arc<Context>, stream: S, limits: tcp::Limits)
where
    S: AsyncRead + AsyncWrite + Send + Unpin + 'static,
{
    let peer = context.peer;
    let result = hyper::server::conn::http1::Builder::new()
        .timer(TokioTimer::new())
        .header_read_timeout(limits.idle_timeout)
        .max_buf_size(MAX_HEAD)
        .serve_connection(
            TokioIo::new(Stalls::new(stream, limits.write_timeout)),
            service(context),
        )
        .await;
    if let Err(err) = result {
        tracing::debug!(%err, %peer, "DNS over HTTP connection ended");
    }
}

async fn serve_http2<S>(context: Arc<Context>, stream: S, limits: tcp::Limits)
where
    S: AsyncRead + AsyncWrite + Send + Unpin + 'static,
{
    let peer = context.peer;
    let streams = u32::try_from(limits.max_in_flight).unwrap_or(u32::MAX);
    let result = hyper::server::conn::http2::Builder::new(TokioExecutor::new())
        .timer(TokioTimer::new())
        .max_concurrent_streams(streams)
        .max_header_list_size(MAX_HEAD as u32)
        .keep_alive_interval(Some(limits.idle_timeout))
        .keep_alive_timeout(limits.write_timeout)
        .serve_connection(
            TokioIo::new(Stalls::new(stream, limits.write_timeout)),
            service(context),
        )
        .await;
    if let Err(err) = result {
        tracing::debug!(%err, %peer, "DNS over HTTPS (HTTP/2) connection ended");
    }
}

/// One request: its query, answered; or the status that says why there is none.
async fn handle(context: &Context, req: Request<Incoming>) -> Response<Full<Bytes>> {
    let query = match read_query(req).await {
        Ok(query) => query,
        Err(status) => return status_only(status),
    };
    match answer(context, &query).await {
        Some(out) => dns_response(out),
        // Not a DNS query (too short for a header, or a response).
        None => status_only(StatusCode::BAD_REQUEST),
    }
}

/// The DNS query a request carries (RFC 8484 §4.1).
async fn read_query<B>(req: Request<B>) -> Result<Vec<u8>, StatusCode>
where
    B: Body,
    B::Error: std::error::Error + Send + Sync + 'static,
{
    if req.uri().path() != PATH {
        return Err(StatusCode::NOT_FOUND);
    }
    match *req.method() {
        Method::GET => get_query(req.uri()),
        Method::POST => {
            check_post(req.headers())?;
            read_body(req.into_body()).await
        }
        _ => Err(StatusCode::METHOD_NOT_ALLOWED),
    }
}

/// `GET ?dns=`: the query, base64url without padding (RFC 8484 §4.1, §6). 400 when it is
/// missing or not base64url.
fn get_query(uri: &Uri) -> Result<Vec<u8>, StatusCode> {
    let dns = uri
        .query()
        .unwrap_or("")
        .split('&')
        .find_map(|pair| pair.strip_prefix("dns="))
        .ok_or(StatusCode::BAD_REQUEST)?;
    // Base64url has no character that needs percent-encoding; a query longer than any DNS
    // message is refused before it is decoded.
    if dns.len() > MAX_BODY.div_ceil(3) * 4 {
        return Err(StatusCode::URI_TOO_LONG);
    }
    data_encoding::BASE64URL_NOPAD
        .decode(dns.as_bytes())
        .map_err(|_| StatusCode::BAD_REQUEST)
}

/// `POST`: the body must be a DNS message (415 otherwise), and no larger than [`MAX_BODY`]
/// (413, from the announced length, before reading any of it).
fn check_post(headers: &HeaderMap) -> Result<(), StatusCode> {
    let media_type = headers
        .get(header::CONTENT_TYPE)
        .and_then(|v| v.to_str().ok())
        .map(|v| v.split(';').next().unwrap_or("").trim());
    if !media_type.is_some_and(|t| t.eq_ignore_ascii_case(DNS_MESSAGE)) {
        return Err(StatusCode::UNSUPPORTED_MEDIA_TYPE);
    }
    let announced = headers
        .get(header::CONTENT_LENGTH)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.parse::<u64>().ok());
    if announced.is_some_and(|len| len > MAX_BODY as u64) {
        return Err(StatusCode::PAYLOAD_TOO_LARGE);
    }
    Ok(())
}

/// The body, read up to [`MAX_BODY`] bytes: 413 beyond it (a chunked body announces no length).
async fn read_body<B>(body: B) -> Result<Vec<u8>, StatusCode>
where
    B: Body,
    B::Error: std::error::Error + Send + Sync + 'static,
{
    match Limited::new(body, MAX_BODY).collect().await {
        Ok(collected) => Ok(collected.to_bytes().to_vec()),
        Err(err) if err.downcast_ref::<LengthLimitError>().is_some() => {
            Err(StatusCode::PAYLOAD_TOO_LARGE)
        }
        Err(_) => Err(StatusCode::BAD_REQUEST),
    }
}

/// What the pipeline did with a query, before any waiting.
enum Started {
    Answered(Vec<u8>),
    Waiting(oneshot::Receiver<Vec<u8>>),
    Dropped,
}

/// `query` answered through the pipeline, as a query over TCP would be; `None` when it is not a
/// query.
async fn answer(context: &Context, query: &[u8]) -> Option<Vec<u8>> {
    let shared = &context.shared;
    let runtime = tokio::runtime::Handle::current();
    let client = Client {
        proto: Proto::Tcp,
        addr: context.peer,
    };
    let started = {
        let to = Recorder {
            counters: shared.metrics.listener(context.local),
            clients: shared.clients.shared(),
            log: &shared.querylog,
        };
        let snap = shared.snapshot.load();
        let now = Instant::now();
        let mut out = Vec::with_capacity(512);
        match pipeline::answer(&to, &snap, query, context.local, &client, now, &mut out) {
            Front::Answered => Started::Answered(out),
            Front::AnsweredRefresh(refresh) => {
                pipeline::refresh(shared, &runtime, refresh);
                Started::Answered(out)
            }
            Front::Dropped => Started::Dropped,
            Front::Miss(mut miss) => {
                let (tx, rx) = oneshot::channel();
                let waiter = miss.waiter(query, ReplyTo::Http(tx), client, now);
                pipeline::spawn(shared, &runtime, miss, waiter);
                Started::Waiting(rx)
            }
        }
    };
    match started {
        Started::Answered(out) => Some(out),
        // The pipeline answers every waiter (SERVFAIL when the upstream fails).
        Started::Waiting(rx) => rx.await.ok(),
        Started::Dropped => None,
    }
}

fn status_only(status: StatusCode) -> Response<Full<Bytes>> {
    let mut resp = Response::new(Full::new(Bytes::new()));
    *resp.status_mut() = status;
    resp
}

fn dns_response(out: Vec<u8>) -> Response<Full<Bytes>> {
    let max_age = max_age(&out);
    let mut resp = Response::new(Full::new(Bytes::from(out)));
    let headers = resp.headers_mut();
    headers.insert(header::CONTENT_TYPE, HeaderValue::from_static(DNS_MESSAGE));
    if let Ok(value) = HeaderValue::from_str(&format!("max-age={max_age}")) {
        headers.insert(header::CACHE_CONTROL, value);
    }
    resp
}

/// How long an HTTP cache may keep `answer` (RFC 8484 §5.1), as CoreDNS reckons it
/// (`dnsutil.MinimalTTL`): the smallest TTL of its records (OPT aside) for an answer, NODATA or
/// NXDOMAIN; 5 s when it has none, or for a failure; never more than an hour.
fn max_age(answer: &[u8]) -> u32 {
    use hickory_proto::op::{Message, ResponseCode};
    use hickory_proto::rr::RecordType;
    let Ok(message) = Message::from_vec(answer) else {
        return DEFAULT_MAX_AGE;
    };
    if !matches!(
        message.metadata.response_code,
        ResponseCode::NoError | ResponseCode::NXDomain
    ) {
        return DEFAULT_MAX_AGE;
    }
    let ttls: Vec<u32> = message
        .answers
        .iter()
        .chain(&message.authorities)
        .chain(&message.additionals)
        .filter(|r| r.record_type() != RecordType::OPT)
        .map(|r| r.ttl)
        .collect();
    match ttls.iter().min() {
        None => DEFAULT_MAX_AGE,
        Some(min) => (*min).min(MAX_MAX_AGE),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A query for `example.com. A`, ID 0 (RFC 8484 §4.1).
    const QUERY: &[u8] = &[
        0, 0, 1, 0, 0, 1, 0, 0, 0, 0, 0, 0, 7, b'e', b'x', b'a', b'm', b'p', b'l', b'e', 3, b'c',
        b'o', b'm', 0, 0, 1, 0, 1,
    ];

    fn request(
        method: Method,
        uri: &str,
        headers: &[(&str, &str)],
        body: Vec<u8>,
    ) -> Request<Full<Bytes>> {
        let mut builder = Request::builder().method(method).uri(uri);
        for (name, value) in headers {
            builder = builder.header(*name, *value);
        }
        builder.body(Full::new(Bytes::from(body))).unwrap()
    }

    async fn query_of(req: Request<Full<Bytes>>) -> Result<Vec<u8>, StatusCode> {
        read_query(req).await
    }

    #[tokio::test]
    async fn a_get_carries_the_query_in_base64url_without_padding() {
        // RFC 8484 §4.1.1's example: `www.example.com. A`, ID 0.
        let uri = "/dns-query?dns=AAABAAABAAAAAAAAA3d3dwdleGFtcGxlA2NvbQAAAQAB";
        let query = query_of(request(Method::GET, uri, &[], Vec::new()))
            .await
            .unwrap();
        assert_eq!(
            query,
            [
                0, 0, 1, 0, 0, 1, 0, 0, 0, 0, 0, 0, 3, b'w', b'w', b'w', 7, b'e', b'x', b'a', b'm',
                b'p', b'l', b'e', 3, b'c', b'o', b'm', 0, 0, 1, 0, 1
            ]
        );
        // Other parameters are allowed beside it.
        let encoded = data_encoding::BASE64URL_NOPAD.encode(QUERY);
        let uri = format!("/dns-query?ct=x&dns={encoded}");
        assert_eq!(
            query_of(request(Method::GET, &uri, &[], Vec::new()))
                .await
                .unwrap(),
            QUERY
        );
    }

    #[tokio::test]
    async fn a_get_without_dns_or_with_padding_or_another_alphabet_is_400() {
        for uri in [
            "/dns-query",
            "/dns-query?name=example.com",
            // Padded: RFC 8484 §6 says without padding (CoreDNS refuses it too).
            "/dns-query?dns=AAABAAABAAAAAAAAA3d3dwdleGFtcGxlA2NvbQAAAQAB==",
            // Standard base64's `+` and `/` are not base64url.
            "/dns-query?dns=AAAB+AAB/AAA",
        ] {
            let got = query_of(request(Method::GET, uri, &[], Vec::new())).await;
            assert_eq!(got, Err(StatusCode::BAD_REQUEST), "{uri}");
        }
    }

    #[tokio::test]
    async fn a_post_carries_the_query_as_its_body() {
        let req = request(
            Method::POST,
            "/dns-query",
            &[("content-type", DNS_MESSAGE)],
            QUERY.to_vec(),
        );
        assert_eq!(query_of(req).await.unwrap(), QUERY);
    }

    #[tokio::test]
    async fn a_post_of_another_media_type_is_415() {
        for headers in [
            &[("content-type", "application/octet-stream")][..],
            &[("content-type", "text/plain")][..],
            &[][..],
        ] {
            let req = request(Method::POST, "/dns-query", headers, QUERY.to_vec());
            assert_eq!(
                query_of(req).await,
                Err(StatusCode::UNSUPPORTED_MEDIA_TYPE),
                "{headers:?}"
            );
        }
    }

    #[tokio::test]
    async fn a_body_larger_than_a_dns_message_is_413_announced_or_not() {
        let announced = request(
            Method::POST,
            "/dns-query",
            &[("content-type", DNS_MESSAGE), ("content-length", "65536")],
            Vec::new(),
        );
        assert_eq!(
            query_of(announced).await,
            Err(StatusCode::PAYLOAD_TOO_LARGE)
        );
        // Not announced (chunked): found while reading, never buffered beyond the limit.
        let unannounced = request(
            Method::POST,
            "/dns-query",
            &[("content-type", DNS_MESSAGE)],
            vec![0; MAX_BODY + 1],
        );
        assert_eq!(
            query_of(unannounced).await,
            Err(StatusCode::PAYLOAD_TOO_LARGE)
        );
        let largest = request(
            Method::POST,
            "/dns-query",
            &[("content-type", DNS_MESSAGE)],
            vec![0; MAX_BODY],
        );
        assert_eq!(query_of(largest).await.unwrap().len(), MAX_BODY);
    }

    #[tokio::test]
    async fn other_paths_are_404_and_other_methods_405() {
        let other = request(Method::GET, "/resolve?dns=AAAB", &[], Vec::new());
        assert_eq!(query_of(other).await, Err(StatusCode::NOT_FOUND));
        let put = request(Method::PUT, "/dns-query", &[], QUERY.to_vec());
        assert_eq!(query_of(put).await, Err(StatusCode::METHOD_NOT_ALLOWED));
    }

    fn reply(
        rcode: hickory_proto::op::ResponseCode,
        ttls: &[u32],
        soa_ttl: Option<u32>,
    ) -> Vec<u8> {
        use hickory_proto::op::{Edns, Message, MessageType};
        use hickory_proto::rr::rdata::{A, SOA};
        use hickory_proto::rr::{Name, RData, Record};
        let name = Name::from_ascii("example.com.").unwrap();
        let mut m = Message::new(0, MessageType::Response, hickory_proto::op::OpCode::Query);
        m.metadata.response_code = rcode;
        for ttl in ttls {
            m.add_answer(Record::from_rdata(
                name.clone(),
                *ttl,
                RData::A(A::new(192, 0, 2, 1)),
            ));
        }
        if let Some(ttl) = soa_ttl {
            let soa = SOA::new(name.clone(), name.clone(), 1, 7200, 1800, 86400, 60);
            m.add_authority(Record::from_rdata(name.clone(), ttl, RData::SOA(soa)));
        }
        m.set_edns(Edns::new());
        m.to_vec().unwrap()
    }

    #[test]
    fn max_age_is_the_smallest_ttl_as_coredns_reckons_it() {
        use hickory_proto::op::ResponseCode;
        assert_eq!(
            max_age(&reply(ResponseCode::NoError, &[300, 30, 60], None)),
            30
        );
        assert_eq!(max_age(&reply(ResponseCode::NXDomain, &[], Some(17))), 17);
        // NODATA with its SOA.
        assert_eq!(max_age(&reply(ResponseCode::NoError, &[], Some(5))), 5);
        // No records (the OPT does not count), a failure, a TTL above an hour.
        assert_eq!(
            max_age(&reply(ResponseCode::NoError, &[], None)),
            DEFAULT_MAX_AGE
        );
        assert_eq!(
            max_age(&reply(ResponseCode::ServFail, &[300], None)),
            DEFAULT_MAX_AGE
        );
        assert_eq!(
            max_age(&reply(ResponseCode::NoError, &[86400], None)),
            MAX_MAX_AGE
        );
        assert_eq!(max_age(b"not dns"), DEFAULT_MAX_AGE);
    }

    #[test]
    fn an_answer_goes_out_as_a_dns_message_with_its_max_age() {
        use hickory_proto::op::ResponseCode;
        let resp = dns_response(reply(ResponseCode::NoError, &[42], None));
        assert_eq!(resp.status(), StatusCode::OK);
        assert_eq!(resp.headers()[header::CONTENT_TYPE], DNS_MESSAGE);
        assert_eq!(resp.headers()[header::CACHE_CONTROL], "max-age=42");
    }
}
