//! Logs on stderr: `text` (colours only when stderr is a terminal, so that files and
//! journald get plain lines) or `json` (one object per line: timestamp, level, target,
//! message, and the event's fields). `KIMI_LOG` sets the filter (`info`,
//! `kimi_server::access=warn`, ...); the default shows warnings, and for `serve` and
//! `gateway` also the start banner and the access log.

use std::fmt;
use std::io::IsTerminal;

use serde_json::{Map, Value};
use tracing::field::{Field, Visit};
use tracing::{Event, Subscriber};
use tracing_subscriber::fmt::format::Writer;
use tracing_subscriber::fmt::{FmtContext, FormatEvent, FormatFields};
use tracing_subscriber::registry::LookupSpan;
use tracing_subscriber::EnvFilter;

use crate::args::LogFormat;

/// The filter when `KIMI_LOG` is not set.
pub fn default_filter(serving: bool) -> &'static str {
    if serving {
        "warn,kimi_server=info,kimi_gateway=info,kimi_infer=info"
    } else {
        "warn"
    }
}

/// Installs the global subscriber.
pub fn init(format: LogFormat, default: &str) {
    let filter = EnvFilter::try_from_env("KIMI_LOG").unwrap_or_else(|_| default.into());
    let builder = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr);
    match format {
        LogFormat::Text => builder.with_ansi(std::io::stderr().is_terminal()).init(),
        LogFormat::Json => builder.event_format(Json).init(),
    }
}

/// One JSON object per event.
struct Json;

impl<S, N> FormatEvent<S, N> for Json
where
    S: Subscriber + for<'a> LookupSpan<'a>,
    N: for<'a> FormatFields<'a> + 'static,
{
    fn format_event(
        &self,
        _ctx: &FmtContext<'_, S, N>,
        mut writer: Writer<'_>,
        event: &Event<'_>,
    ) -> fmt::Result {
        let meta = event.metadata();
        let mut object = Map::new();
        object.insert("timestamp".into(), Value::String(utc_now()));
        object.insert("level".into(), Value::String(meta.level().to_string()));
        object.insert("target".into(), Value::String(meta.target().to_string()));
        let mut fields = Fields(Map::new());
        event.record(&mut fields);
        object.extend(fields.0);
        writeln!(writer, "{}", Value::Object(object))
    }
}

/// An event's fields as JSON values.
struct Fields(Map<String, Value>);

impl Fields {
    fn put(&mut self, field: &Field, value: Value) {
        self.0.insert(field.name().to_string(), value);
    }
}

impl Visit for Fields {
    fn record_debug(&mut self, field: &Field, value: &dyn fmt::Debug) {
        self.put(field, Value::String(format!("{value:?}")));
    }
    fn record_str(&mut self, field: &Field, value: &str) {
        self.put(field, Value::String(value.to_string()));
    }
    fn record_i64(&mut self, field: &Field, value: i64) {
        self.put(field, value.into());
    }
    fn record_u64(&mut self, field: &Field, value: u64) {
        self.put(field, value.into());
    }
    fn record_f64(&mut self, field: &Field, value: f64) {
        self.put(
            field,
            serde_json::Number::from_f64(value).map_or(Value::Null, Value::Number),
        );
    }
    fn record_bool(&mut self, field: &Field, value: bool) {
        self.put(field, value.into());
    }
}

/// The time now as RFC 3339 in UTC, to the millisecond.
fn utc_now() -> String {
    let now = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap_or_default();
    rfc3339(now.as_secs() as i64, now.subsec_millis())
}

/// Seconds since the epoch as `2026-12-03T12:48:07.123Z` (days to civil date after
/// Howard Hinnant's algorithm).
fn rfc3339(secs: i64, millis: u32) -> String {
    let (days, rem) = (secs.div_euclid(86_400), secs.rem_euclid(86_400));
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
        "{year:04}-{month:02}-{day:02}T{:02}:{:02}:{:02}.{millis:03}Z",
        rem / 3600,
        rem / 60 % 60,
        rem % 60
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn timestamps_are_rfc3339_utc() {
        assert_eq!(rfc3339(0, 0), "1970-01-01T00:00:00.000Z");
        assert_eq!(rfc3339(951_782_400, 5), "2000-02-29T00:00:00.005Z");
        assert_eq!(rfc3339(1_796_303_511, 999), "2026-12-03T13:11:51.999Z");
    }
}
