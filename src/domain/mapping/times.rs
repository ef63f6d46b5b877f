//! Times and dates as PostgreSQL reads them, pure: a `timestamptz` column's RFC 3339 time and a
//! `date` column's `YYYY-MM-DD`, with years up to where the column types end (a timestamptz to
//! 294276-12-31T23:59:59.999999Z, a date to 5874897-12-31), and the AMQP timestamp property
//! (seconds) as an RFC 3339 time. The `time` crate reads four-digit years only: a longer year
//! is read through a stand-in year of the same place in the 400-year Gregorian cycle (the same
//! leap days), and the range is checked on the year as written.

use time::format_description::well_known::Rfc3339;

use super::ValueError;
use super::values::{check_year, clip};

/// The last year a `timestamptz` holds (its last instant 294276-12-31T23:59:59.999999 UTC).
pub const TIMESTAMPTZ_MAX_YEAR: u64 = 294_276;
/// The last year a `date` holds (5874897-12-31).
pub const DATE_MAX_YEAR: u64 = 5_874_897;
/// The last whole second a `timestamptz` holds, in Unix seconds (294276-12-31T23:59:59Z).
pub const TIMESTAMPTZ_MAX_SECS: u64 = 9_224_318_015_999;

/// Seconds in 400 Gregorian years: the calendar repeats after them.
const CYCLE_SECS: u64 = 146_097 * 86_400;

/// A year of more than four digits (`10000-01-01`, `010000-...`: PostgreSQL reads it) at the
/// start of `text`: the year, and `text` with a four-digit year of the same place in the 400
/// year cycle (2000 to 2399) in its place. `None` for a year of four digits or fewer; a year of
/// more digits than a `u64` holds is `u64::MAX`.
fn wide_year(text: &str) -> Option<(u64, String)> {
    let digits = text.bytes().take_while(u8::is_ascii_digit).count();
    if digits <= 4 || text.as_bytes().get(digits) != Some(&b'-') {
        return None;
    }
    let year: u64 = text[..digits].parse().unwrap_or(u64::MAX);
    Some((year, format!("{}{}", 2000 + year % 400, &text[digits..])))
}

/// A `timestamptz` column's value: an RFC 3339 time PostgreSQL stores (a year from 0001, up to
/// the end of a timestamptz; an offset within ±15:59), or why not.
pub(super) fn timestamptz(s: &str) -> Result<(), ValueError> {
    let wide = wide_year(s);
    let read = wide.as_ref().map_or(s, |(_, stand_in)| stand_in.as_str());
    let t = time::OffsetDateTime::parse(read, &Rfc3339).map_err(|e| {
        ValueError::Unfit(format!(
            "expected an RFC 3339 time, found {:?} ({e})",
            clip(s)
        ))
    })?;
    // PostgreSQL reads UTC offsets up to 15:59 either way.
    if t.offset().whole_minutes().unsigned_abs() > 15 * 60 + 59 {
        return Err(ValueError::Unfit(format!(
            "expected a UTC offset from -15:59 to +15:59 (what PostgreSQL reads), found {:?}",
            clip(s)
        )));
    }
    let Some((year, _)) = wide else {
        return check_year(t.year(), s);
    };
    check_year(i32::try_from(year).unwrap_or(i32::MAX), s)?;
    // The end is an instant: the year in UTC, and PostgreSQL rounds to microseconds.
    let utc = t.to_offset(time::UtcOffset::UTC);
    let utc_year = year.saturating_add_signed(i64::from(utc.year() - t.year()));
    let past_the_last_microsecond = utc.month() == time::Month::December
        && utc.day() == 31
        && (utc.hour(), utc.minute(), utc.second()) == (23, 59, 59)
        && utc.nanosecond() >= 999_999_500;
    if utc_year > TIMESTAMPTZ_MAX_YEAR
        || (utc_year == TIMESTAMPTZ_MAX_YEAR && past_the_last_microsecond)
    {
        return Err(ValueError::Unfit(format!(
            "expected a time up to {TIMESTAMPTZ_MAX_YEAR}-12-31T23:59:59.999999Z (the last a \
             PostgreSQL timestamptz holds), found {:?}",
            clip(s)
        )));
    }
    Ok(())
}

/// A `date` column's value: `YYYY-MM-DD` PostgreSQL stores (a year from 0001 without a sign,
/// up to the end of a date; a longer year as `10000-01-01`), or why not.
pub(super) fn date(s: &str) -> Result<(), ValueError> {
    let format = time::macros::format_description!("[year]-[month]-[day]");
    let wide = wide_year(s);
    let read = wide.as_ref().map_or(s, |(_, stand_in)| stand_in.as_str());
    let d = time::Date::parse(read, format).map_err(|e| {
        ValueError::Unfit(format!(
            "expected a date YYYY-MM-DD, found {:?} ({e})",
            clip(s)
        ))
    })?;
    match wide {
        None => check_year(d.year(), s)?,
        Some((year, _)) => {
            check_year(i32::try_from(year).unwrap_or(i32::MAX), s)?;
            if year > DATE_MAX_YEAR {
                return Err(ValueError::Unfit(format!(
                    "expected a date up to {DATE_MAX_YEAR}-12-31 (the last a PostgreSQL date \
                     holds), found {:?}",
                    clip(s)
                )));
            }
        }
    }
    if s.starts_with(['+', '-']) {
        return Err(ValueError::Unfit(format!(
            "expected a date YYYY-MM-DD, its year without a sign, found {:?}",
            clip(s)
        )));
    }
    Ok(())
}

/// The AMQP timestamp `secs` (Unix seconds, as a `timestamp` property carries it) as an RFC
/// 3339 time in UTC, as PostgreSQL reads it (a year past 9999 written with its digits), or why
/// not: past the last second a timestamptz holds.
pub(super) fn of_unix_seconds(secs: u64) -> Result<String, ValueError> {
    if secs > TIMESTAMPTZ_MAX_SECS {
        return Err(ValueError::Unfit(format!(
            "the timestamp {secs} (Unix seconds) is past {TIMESTAMPTZ_MAX_SECS}, \
             {TIMESTAMPTZ_MAX_YEAR}-12-31T23:59:59Z, the last second a PostgreSQL timestamptz \
             holds"
        )));
    }
    let cycles = secs / CYCLE_SECS;
    // Within 1970 to 2369, which `time` holds; the calendar is the same 400 years later.
    let t = time::OffsetDateTime::from_unix_timestamp((secs % CYCLE_SECS) as i64)
        .map_err(|e| ValueError::Unfit(format!("the timestamp {secs}: {e}")))?;
    Ok(format!(
        "{:04}-{:02}-{:02}T{:02}:{:02}:{:02}Z",
        t.year() as u64 + 400 * cycles,
        u8::from(t.month()),
        t.day(),
        t.hour(),
        t.minute(),
        t.second()
    ))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn refused(r: Result<(), ValueError>) -> String {
        match r {
            Err(e) => e.to_string(),
            Ok(()) => panic!("accepted"),
        }
    }

    #[test]
    fn a_timestamptz_takes_the_years_postgresql_does() {
        // Each checked against PostgreSQL 16 (`select '...'::timestamptz`).
        for ok in [
            "2026-11-24T10:00:00Z",
            "9999-12-31T23:59:59-15:59",
            "10000-01-01T00:00:00Z",
            "010000-01-01T00:00:00Z",
            "10000-02-29T00:00:00Z",
            "99999-01-01T00:00:00+15:59",
            "294276-12-31T23:59:59Z",
            "294276-12-31T23:59:59.9999994Z",
            "294277-01-01T00:30:00+01:00",
        ] {
            assert_eq!(timestamptz(ok), Ok(()), "{ok}");
        }
        for past in [
            "294277-01-01T00:00:00Z",
            "294276-12-31T23:59:59-01:00",
            "294276-12-31T23:59:59.9999995Z",
            "999999999999999999999999-01-01T00:00:00Z",
        ] {
            let words = refused(timestamptz(past));
            assert!(
                words.contains("expected a time up to 294276-12-31T23:59:59.999999Z")
                    && words.contains("PostgreSQL timestamptz"),
                "{past}: {words}"
            );
        }
        // Not a day of that year (10100 is no leap year), as for a four-digit year.
        assert!(refused(timestamptz("10100-02-29T00:00:00Z")).contains("expected an RFC 3339"));
        assert!(refused(timestamptz("00000-01-01T00:00:00Z")).contains("from 0001"));
        assert!(refused(timestamptz("0000-01-01T00:00:00Z")).contains("from 0001"));
    }

    #[test]
    fn a_date_takes_the_years_postgresql_does() {
        for ok in ["2026-11-24", "10000-01-01", "5874897-12-31"] {
            assert_eq!(date(ok), Ok(()), "{ok}");
        }
        let words = refused(date("5874898-01-01"));
        assert!(words.contains("up to 5874897-12-31"), "{words}");
        assert!(refused(date("+2026-01-01")).contains("without a sign"));
        assert!(refused(date("10100-02-29")).contains("expected a date"));
    }

    #[test]
    fn a_timestamp_property_is_written_as_postgresql_reads_it_up_to_its_last_second() {
        assert_eq!(of_unix_seconds(0).as_deref(), Ok("1970-01-01T00:00:00Z"));
        assert_eq!(
            of_unix_seconds(1_795_928_690).as_deref(),
            Ok("2026-11-29T05:04:50Z")
        );
        // The first second of 10000 (`select extract(epoch from '10000-01-01Z'::timestamptz)`).
        assert_eq!(
            of_unix_seconds(253_402_300_800).as_deref(),
            Ok("10000-01-01T00:00:00Z")
        );
        assert_eq!(
            of_unix_seconds(TIMESTAMPTZ_MAX_SECS).as_deref(),
            Ok("294276-12-31T23:59:59Z")
        );
        let words = of_unix_seconds(TIMESTAMPTZ_MAX_SECS + 1)
            .err()
            .map(|e| e.to_string())
            .unwrap_or_default();
        assert!(
            words.contains("294276-12-31T23:59:59Z, the last second a PostgreSQL timestamptz"),
            "{words}"
        );
        assert!(of_unix_seconds(u64::MAX).is_err());
        // Each written time is one timestamptz takes.
        for secs in [0, 253_402_300_800, TIMESTAMPTZ_MAX_SECS] {
            let text = of_unix_seconds(secs).unwrap_or_default();
            assert_eq!(timestamptz(&text), Ok(()), "{text}");
        }
    }
}
