//! What a token-less peer sends before it is proven, shared by the hostile
//! campaign and the environment's hostile-neighbour tests: unfinished
//! gRPC messages on an HTTP/2 connection (memory before proof); and what a
//! listener squatting a port reads of a client's first request (the
//! client's proof of the server).

use std::time::Instant;

use tokio::net::TcpStream;

/// The health service's Check method, which answers without a token.
pub const HEALTH_CHECK: &str = "/grpc.health.v1.Health/Check";

/// Serves HTTP/2 on `sock` as a squatter would and returns the
/// `authorization` header of the first request, if one comes with one.
pub async fn first_authorization(sock: TcpStream) -> Option<String> {
    let mut h2s = h2::server::handshake(sock).await.ok()?;
    let (request, _respond) = h2s.accept().await?.ok()?;
    request
        .headers()
        .get("authorization")
        .map(|v| v.to_str().unwrap_or_default().to_string())
}

/// Sends unfinished `Health/Check` messages on the HTTP/2 connection over
/// `sock`, each on a stream of its own: every message declares 4 MiB and
/// sends 16 KiB, up to `max_bytes` in all; then holds the connection.
/// Returns whether the server closed it before `until` (else it was still
/// open then).
pub async fn unfinished_health_checks(sock: TcpStream, max_bytes: usize, until: Instant) -> bool {
    let Ok((mut client, connection)) = h2::client::handshake(sock).await else {
        return true;
    };
    let mut connection = tokio::spawn(connection);
    let mut message = vec![0u8; 16 << 10];
    message[1..5].copy_from_slice(&(4u32 << 20).to_be_bytes());
    let message = bytes::Bytes::from(message);
    // Held open (not reset) until the end: their unfinished messages are
    // what the server would buffer.
    let mut streams = Vec::new();
    let mut sent = 0;
    while sent < max_bytes && Instant::now() < until {
        let ready = tokio::select! {
            r = client.clone().ready() => r,
            _ = &mut connection => return true,
            () = tokio::time::sleep_until(until.into()) => return false,
        };
        let Ok(mut ready) = ready else { return true };
        let request = http::Request::post(format!("http://lockstep{HEALTH_CHECK}"))
            .header("content-type", "application/grpc")
            .header("te", "trailers")
            .body(())
            .expect("a request");
        let Ok((response, mut body)) = ready.send_request(request, false) else {
            return true;
        };
        if body.send_data(message.clone(), false).is_err() {
            return true;
        }
        sent += message.len();
        streams.push((response, body));
        client = ready;
    }
    tokio::select! {
        _ = connection => true,
        () = tokio::time::sleep_until(until.into()) => false,
    }
}
