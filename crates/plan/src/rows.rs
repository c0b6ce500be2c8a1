//! The built-in family's rows: 64-bit integers, encoded on the wire as their
//! varints back to back (exactly the bytes of a packed protobuf `repeated
//! int64`, which is what rows were on the wire up to v0.2.0).
//!
//! The control plane carries rows as bytes it does not read
//! ([`lockstep_protocol::Row`]); this module is where the plan language's
//! rows become bytes and back. Only canonical encodings are rows: each value
//! in its shortest varint, so a list of values has exactly one encoding.

use lockstep_protocol::Row;

/// A row of the plan language: its columns.
pub type Values = Vec<i64>;

/// Why bytes are not a row of this family.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("a row of {FORMAT} is 64-bit integers as canonical varints; these {len} bytes are not", FORMAT = crate::FORMAT)]
pub struct RowError {
    /// How many bytes the row had.
    pub len: usize,
}

/// The encoding of `values`.
pub fn encode(values: &[i64]) -> Row {
    let mut out = Vec::with_capacity(values.len() * 2);
    encode_into(values, &mut out);
    out
}

/// Appends the encoding of `values` to `out`.
pub fn encode_into(values: &[i64], out: &mut Vec<u8>) {
    for &v in values {
        prost::encoding::encode_varint(v as u64, out);
    }
}

/// Whether `row` is a row of this family (what [`decode`] accepts), without
/// decoding it.
pub fn check(row: &[u8]) -> Result<(), RowError> {
    if lockstep_protocol::is_canonical_varints(row) {
        Ok(())
    } else {
        Err(RowError { len: row.len() })
    }
}

/// The values `row` encodes, or why it is not a row of this family.
pub fn decode(row: &[u8]) -> Result<Values, RowError> {
    let n = lockstep_protocol::varint_count(row).ok_or(RowError { len: row.len() })?;
    let mut values = Vec::with_capacity(n);
    values.extend(lockstep_protocol::varint_values(row));
    Ok(values)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rows_round_trip_and_match_the_packed_int64_encoding() {
        for values in [vec![], vec![0], vec![1, -1], vec![i64::MIN, i64::MAX, 300]] {
            let row = encode(&values);
            assert_eq!(decode(&row), Ok(values.clone()));
            // What prost writes for a packed `repeated int64` field, less
            // its tag and length.
            let mut packed = Vec::new();
            prost::encoding::int64::encode_packed(1, &values, &mut packed);
            if !values.is_empty() {
                let header = 1 + prost::encoding::encoded_len_varint(row.len() as u64);
                assert_eq!(&packed[header..], &row[..]);
            }
        }
    }

    #[test]
    fn non_canonical_and_truncated_bytes_are_refused() {
        // 1 written in two bytes; a varint cut short; an 11-byte varint.
        for bytes in [&[0x81, 0x00][..], &[0x80][..], &[0xff; 11][..]] {
            assert_eq!(decode(bytes), Err(RowError { len: bytes.len() }));
        }
    }
}
