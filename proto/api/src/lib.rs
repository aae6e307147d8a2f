//! Airlock's public gRPC API, generated from `proto/airlock.proto` (package `airlock.v1`), the
//! normative description of every call and field. Used by `airlockd` (server), the `airlock`
//! CLI, the system tests and the benchmarks (clients).
#![forbid(unsafe_code)]
#![allow(missing_debug_implementations)] // generated code

/// Types, client and server of `airlock.v1`.
pub mod audit;

pub mod v1 {
    tonic::include_proto!("airlock.v1");
}

/// The encoded file descriptor set of the API, for gRPC server reflection.
pub const FILE_DESCRIPTOR_SET: &[u8] = tonic::include_file_descriptor_set!("airlock_descriptor");

/// Domain of every `google.rpc.ErrorInfo` the daemon sends.
pub const ERROR_DOMAIN: &str = "airlock.dev";

/// The default path of the daemon's Unix socket.
pub const DEFAULT_SOCKET: &str = "/run/airlock/airlockd.sock";

/// Environment variable that overrides the daemon address for clients (`unix:///PATH`,
/// `unix:PATH`, a bare path, or `http://HOST:PORT`).
pub const ADDR_ENV: &str = "AIRLOCK_ADDR";

/// Where clients find the daemon: `$AIRLOCK_ADDR` if set, else [`DEFAULT_SOCKET`].
/// Unix milliseconds as UTC in RFC 3339, `2024-05-01T12:34:56.789Z` (the CLI's times, the E2B
/// gateway's).
pub fn utc_time(unix_ms: i64) -> String {
    let (secs, ms) = (unix_ms.div_euclid(1000), unix_ms.rem_euclid(1000));
    let (days, rem) = (secs.div_euclid(86_400), secs.rem_euclid(86_400));
    // Days since 1970-01-01 to a civil date (Howard Hinnant's algorithm).
    let z = days + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z.rem_euclid(146_097);
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let day = doy - (153 * mp + 2) / 5 + 1;
    let month = if mp < 10 { mp + 3 } else { mp - 9 };
    let year = yoe + era * 400 + i64::from(month <= 2);
    format!(
        "{year:04}-{month:02}-{day:02}T{:02}:{:02}:{:02}.{ms:03}Z",
        rem / 3600,
        rem % 3600 / 60,
        rem % 60
    )
}

pub fn default_address() -> String {
    std::env::var(ADDR_ENV)
        .ok()
        .filter(|a| !a.is_empty())
        .unwrap_or_else(|| format!("unix://{DEFAULT_SOCKET}"))
}

/// Connects a channel to `address`: `unix:///PATH`, `unix:PATH`, a bare absolute path,
/// `https://HOST:PORT` (TLS: see [`CA_CERT_ENV`]), or `http://HOST:PORT` / `tcp://HOST:PORT`
/// (plaintext, for daemons that allow it).
pub async fn connect(address: &str) -> Result<tonic::transport::Channel, tonic::transport::Error> {
    use tonic::transport::Endpoint;
    let unix = address
        .strip_prefix("unix://")
        .or_else(|| address.strip_prefix("unix:"))
        .or_else(|| address.starts_with('/').then_some(address));
    match unix {
        Some(path) => {
            let path = std::path::PathBuf::from(path);
            // The URI is not used for a Unix socket; the connector is.
            Endpoint::from_static("http://localhost")
                .connect_with_connector(tower::service_fn(move |_| {
                    let path = path.clone();
                    async move {
                        let s = tokio::net::UnixStream::connect(path).await?;
                        Ok::<_, std::io::Error>(hyper_util::rt::TokioIo::new(s))
                    }
                }))
                .await
        }
        None => {
            let url = match address.strip_prefix("tcp://") {
                Some(hp) => format!("http://{hp}"),
                None => address.to_owned(),
            };
            let mut endpoint = Endpoint::from_shared(url)?;
            if address.starts_with("https://") {
                endpoint = endpoint.tls_config(client_tls())?;
            }
            endpoint.connect().await
        }
    }
}

/// Environment variables of a TLS client: the CA that signed the daemon's certificate (PEM;
/// default: none, so the connection fails), and for mutual TLS the client's certificate and key.
pub const CA_CERT_ENV: &str = "AIRLOCK_CA_CERT";
pub const CLIENT_CERT_ENV: &str = "AIRLOCK_CLIENT_CERT";
pub const CLIENT_KEY_ENV: &str = "AIRLOCK_CLIENT_KEY";

/// The TLS settings of an `https://` address, from the environment.
fn client_tls() -> tonic::transport::ClientTlsConfig {
    use tonic::transport::{Certificate, ClientTlsConfig, Identity};
    let file = |var: &str| {
        std::env::var_os(var)
            .filter(|p| !p.is_empty())
            .and_then(|p| std::fs::read(p).ok())
    };
    let mut tls = ClientTlsConfig::new();
    if let Some(ca) = file(CA_CERT_ENV) {
        tls = tls.ca_certificate(Certificate::from_pem(ca));
    }
    if let (Some(cert), Some(key)) = (file(CLIENT_CERT_ENV), file(CLIENT_KEY_ENV)) {
        tls = tls.identity(Identity::from_pem(cert, key));
    }
    tls
}

/// A client for `address` ([`default_address`] when `None`) that sends `token` (if any) as
/// `authorization: Bearer TOKEN` on every call.
pub async fn client(
    address: Option<&str>,
    token: Option<&str>,
) -> Result<v1::airlock_client::AirlockClient<AuthChannel>, tonic::transport::Error> {
    let addr = address.map(str::to_owned).unwrap_or_else(default_address);
    let channel = connect(&addr).await?;
    let header = token.map(|t| {
        format!("Bearer {t}")
            .parse::<tonic::metadata::MetadataValue<tonic::metadata::Ascii>>()
            .unwrap_or_else(|_| tonic::metadata::MetadataValue::from_static("Bearer invalid"))
    });
    Ok(v1::airlock_client::AirlockClient::with_interceptor(
        channel,
        TokenAuth { header },
    ))
}

/// Sends a tenant token as `authorization: Bearer TOKEN` on every call.
#[derive(Clone, Debug)]
pub struct TokenAuth {
    header: Option<tonic::metadata::MetadataValue<tonic::metadata::Ascii>>,
}

impl tonic::service::Interceptor for TokenAuth {
    fn call(&mut self, mut req: tonic::Request<()>) -> Result<tonic::Request<()>, tonic::Status> {
        if let Some(h) = &self.header {
            req.metadata_mut().insert("authorization", h.clone());
        }
        Ok(req)
    }
}

/// The channel type of [`client`].
pub type AuthChannel =
    tonic::service::interceptor::InterceptedService<tonic::transport::Channel, TokenAuth>;

/// The `google.rpc.ErrorInfo` of a failed call (reason and metadata), if it has one.
pub fn error_info(
    status: &tonic::Status,
) -> Option<(String, std::collections::HashMap<String, String>)> {
    use prost::Message;
    // google.rpc.Status { code = 1, message = 2, details = 3 (Any { type_url = 1, value = 2 }) }
    #[derive(Clone, PartialEq, Message)]
    struct Any {
        #[prost(string, tag = "1")]
        type_url: String,
        #[prost(bytes = "vec", tag = "2")]
        value: Vec<u8>,
    }
    #[derive(Clone, PartialEq, Message)]
    struct RpcStatus {
        #[prost(int32, tag = "1")]
        code: i32,
        #[prost(string, tag = "2")]
        message: String,
        #[prost(message, repeated, tag = "3")]
        details: Vec<Any>,
    }
    #[derive(Clone, PartialEq, Message)]
    struct ErrorInfo {
        #[prost(string, tag = "1")]
        reason: String,
        #[prost(string, tag = "2")]
        domain: String,
        #[prost(map = "string, string", tag = "3")]
        metadata: std::collections::HashMap<String, String>,
    }
    let st = RpcStatus::decode(status.details()).ok()?;
    st.details
        .iter()
        .find(|a| a.type_url.ends_with("google.rpc.ErrorInfo"))
        .and_then(|a| ErrorInfo::decode(a.value.as_slice()).ok())
        .map(|i| (i.reason, i.metadata))
}

#[cfg(test)]
mod tests {
    #[test]
    fn utc_time_matches_known_dates() {
        assert_eq!(super::utc_time(0), "1970-01-01T00:00:00.000Z");
        assert_eq!(
            super::utc_time(1_735_689_600_123),
            "2025-01-01T00:00:00.123Z"
        );
        assert_eq!(super::utc_time(951_782_400_000), "2000-02-29T00:00:00.000Z");
    }
}
