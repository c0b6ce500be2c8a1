//! What the control plane reads of a row, which is otherwise its family's
//! bytes: which worker introduces it ([`row_owner`]) and, for a row of
//! canonical varints (the built-in family's, and every row up to v0.2.0),
//! its 64-bit values ([`varint_count`], [`varint_values`]), read on the hot
//! path of every write's owner, digest and order.

/// The global index of the worker that introduces `row` into a replica of
/// `workers` timely workers in all (process `p`'s workers are
/// `p * workers_per_process ..`), modulo `workers` of a splitmix64 fold.
/// Specified here, not left to a std hasher, because the controller (which
/// splits writes per process) and the replica (whose workers keep only the
/// rows they own) must agree even when built apart.
///
/// A row whose bytes are canonical varints ([`varint_values`]: every row of
/// the built-in family, and every row up to v0.2.0, when rows were integer
/// vectors on the wire) folds its length and values as v0.2.0 did, so a
/// v0.2.0 process and this one split alike; any other row folds its byte
/// length and its bytes in 8-byte words from another seed.
pub fn row_owner(row: &[u8], workers: usize) -> usize {
    fn mix(mut z: u64) -> u64 {
        z = z.wrapping_add(0x9E37_79B9_7F4A_7C15);
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }
    if workers <= 1 {
        return 0;
    }
    // One pass for the canonical case: the count is the number of bytes
    // that end a varint, and a row that turns out not to be canonical
    // varints is folded again as bytes.
    let canonical = || {
        let n = row.iter().filter(|b| **b < 0x80).count();
        let mut h = mix(n as u64);
        for_each_canonical_varint(row, |v| h = mix(h ^ v)).then_some(h)
    };
    let h = canonical().unwrap_or_else(|| {
        let mut h = mix(row.len() as u64 ^ OPAQUE_ROW_SEED);
        for chunk in row.chunks(8) {
            let mut word = [0u8; 8];
            word[..chunk.len()].copy_from_slice(chunk);
            h = mix(h ^ u64::from_le_bytes(word));
        }
        h
    });
    (h % workers.max(1) as u64) as usize
}

/// Seeds [`row_owner`]'s fold for a row that is not canonical varints.
const OPAQUE_ROW_SEED: u64 = 0x6c6f_636b_7374_6570;

/// How many values `row` holds if it is canonical varints back to back (each
/// the shortest encoding of its 64-bit value, as protobuf encodes a packed
/// `int64`), else `None`.
pub fn varint_count(row: &[u8]) -> Option<usize> {
    let mut n = 0;
    for_each_canonical_varint(row, |_| n += 1).then_some(n)
}

/// Whether `row` is canonical varints back to back (exactly the rows
/// [`varint_count`] counts), by one scan of its bytes without decoding a
/// value: a varint ends at a byte below `0x80`, has at most ten bytes (the
/// tenth `0x01`), and is the shortest encoding of its value unless it ends
/// in a zero byte after a continuation byte. The built-in family's check of
/// every written row.
#[inline]
pub fn is_canonical_varints(row: &[u8]) -> bool {
    if row.len() <= 8 {
        return short_canonical_varints(row);
    }
    // Continuation bytes of the varint under way.
    let mut run = 0u32;
    for &b in row {
        if b >= 0x80 {
            run += 1;
            if run == 10 {
                return false;
            }
        } else {
            if run > 0 && (b == 0 || (run == 9 && b > 1)) {
                return false;
            }
            run = 0;
        }
    }
    run == 0
}

/// [`is_canonical_varints`] of a row of at most 8 bytes (no varint in it
/// can reach ten bytes), on the row as one word: it must end in a byte
/// below `0x80`, and no zero byte may follow a continuation byte.
#[inline]
fn short_canonical_varints(row: &[u8]) -> bool {
    const HIGH: u64 = 0x8080_8080_8080_8080;
    const LOW: u64 = 0x7f7f_7f7f_7f7f_7f7f;
    let n = row.len();
    if n == 0 {
        return true;
    }
    let w = row
        .iter()
        .enumerate()
        .fold(0u64, |w, (i, b)| w | (*b as u64) << (8 * i));
    // The row's bytes (the rest of the word is padding).
    let mask = u64::MAX >> (8 * (8 - n));
    let continues = w & HIGH;
    // The high bit of every zero byte, exactly (no carry between bytes).
    let zero = !(((w & LOW) + LOW) | w) & HIGH;
    let last_continues = continues >> (8 * (n - 1)) != 0;
    let overlong = zero & (continues << 8) & mask;
    !last_continues && overlong == 0
}

/// Calls `f` with each value of `row` if it is canonical varints
/// ([`varint_count`]), in one pass; `false` (having called `f` with the
/// values before the first that is not canonical) if it is not.
#[inline]
pub(crate) fn for_each_canonical_varint(row: &[u8], mut f: impl FnMut(u64)) -> bool {
    let mut pos = 0;
    while pos < row.len() {
        let start = pos;
        let Some(v) = next_varint(row, &mut pos) else {
            return false;
        };
        if pos - start != prost::encoding::encoded_len_varint(v) {
            return false;
        }
        f(v);
    }
    true
}

/// The 64-bit values of a row [`varint_count`] accepted, in order (on other
/// bytes it stops at the first that does not decode).
pub fn varint_values(row: &[u8]) -> impl Iterator<Item = i64> + '_ {
    let mut pos = 0;
    std::iter::from_fn(move || next_varint(row, &mut pos).map(|v| v as i64))
}

/// The varint at `*pos` in `buf` (advancing `*pos` past it), decoded as
/// protobuf decodes one: at most ten bytes, the tenth at most 1. `None` at
/// the end of `buf`, or where no varint decodes. On the hot path of every
/// row's owner, digest and order, hence written out rather than going
/// through `bytes::Buf`.
#[inline]
pub(crate) fn next_varint(buf: &[u8], pos: &mut usize) -> Option<u64> {
    let mut v = 0u64;
    for k in 0..10 {
        let b = *buf.get(*pos)?;
        *pos += 1;
        if k == 9 && b > 1 {
            return None;
        }
        v |= u64::from(b & 0x7f) << (7 * k);
        if b < 0x80 {
            return Some(v);
        }
    }
    None
}

#[cfg(test)]
mod tests {
    /// The byte scan accepts exactly the rows the decoding check counts:
    /// every row of up to four bytes from a set rich in edge bytes (and
    /// six- and eight-byte rows around them), every
    /// value's encoding, overlong and eleven-byte varints, and random rows.
    #[test]
    fn the_byte_scan_agrees_with_the_decoding_check() {
        let agree = |row: &[u8]| {
            assert_eq!(
                is_canonical_varints(row),
                varint_count(row).is_some(),
                "{row:02x?}"
            )
        };
        let edges = [0x00, 0x01, 0x02, 0x7f, 0x80, 0x81, 0xfe, 0xff];
        agree(&[]);
        for a in edges {
            agree(&[a]);
            for b in edges {
                agree(&[a, b]);
                for c in edges {
                    agree(&[a, b, c]);
                    for d in edges {
                        agree(&[a, b, c, d]);
                        // Every place a row of up to 8 bytes can end.
                        agree(&[0x81, a, 0x80, b, c, d]);
                        agree(&[0x01, 0x80, a, b, 0x05, c, 0x81, d]);
                    }
                }
            }
        }
        for v in [0u64, 1, 127, 128, 300, 1 << 35, u64::MAX >> 1, u64::MAX] {
            let mut row = Vec::new();
            prost::encoding::encode_varint(v, &mut row);
            agree(&row);
            assert!(is_canonical_varints(&row));
            // Overlong: one more continuation byte and a zero.
            let last = row.len() - 1;
            row[last] |= 0x80;
            row.push(0);
            agree(&row);
        }
        // Ten bytes ending in 2 (past 64 bits), and eleven bytes.
        let mut ten = vec![0xffu8; 9];
        ten.push(0x02);
        agree(&ten);
        agree(&[0xff; 10]);
        let mut eleven = vec![0x80u8; 10];
        eleven.push(0x01);
        agree(&eleven);
        let mut seed = 0x1234_5678_9abc_def0u64;
        for _ in 0..200_000 {
            seed ^= seed << 13;
            seed ^= seed >> 7;
            seed ^= seed << 17;
            let len = (seed % 24) as usize;
            let row: Vec<u8> = (0..len)
                .map(|k| {
                    let byte = (seed >> (k % 8 * 8)) as u8;
                    // Mostly continuation bytes, so that long varints occur.
                    if k % 3 == 2 {
                        byte & 0x7f
                    } else {
                        byte | 0x80
                    }
                })
                .collect();
            agree(&row);
        }
    }

    use super::*;

    /// What prost's own decoder reads from `bytes`, one varint after
    /// another, until the end or the first that does not decode.
    fn prost_values(bytes: &[u8]) -> Vec<u64> {
        let mut rest = bytes;
        let mut out = Vec::new();
        while !rest.is_empty() {
            match prost::encoding::decode_varint(&mut rest) {
                Ok(v) => out.push(v),
                Err(_) => break,
            }
        }
        out
    }

    #[test]
    fn the_row_varint_reader_decodes_what_prost_decodes() {
        let mut cases: Vec<Vec<u8>> = vec![
            vec![],
            vec![0],
            vec![0x80],
            vec![0x81, 0x00],
            vec![0xff; 9],
            vec![0xff; 10],
            vec![0xff; 11],
            [vec![0xff; 9], vec![0x01]].concat(),
            [vec![0xff; 9], vec![0x02]].concat(),
            [vec![0x80; 9], vec![0x00]].concat(),
        ];
        // Every value's canonical encoding, and some noise.
        for v in [0u64, 1, 127, 128, 300, 1 << 35, u64::MAX, i64::MIN as u64] {
            let mut b = Vec::new();
            prost::encoding::encode_varint(v, &mut b);
            cases.push(b);
        }
        let mut x = 0x2545_f491_4f6c_dd1du64;
        for len in 0..64 {
            let bytes: Vec<u8> = (0..len)
                .map(|_| {
                    x ^= x << 13;
                    x ^= x >> 7;
                    x ^= x << 17;
                    x as u8
                })
                .collect();
            cases.push(bytes);
        }
        for bytes in cases {
            let ours: Vec<u64> = varint_values(&bytes).map(|v| v as u64).collect();
            assert_eq!(ours, prost_values(&bytes), "{bytes:02x?}");
            let canonical = {
                let mut rest = &bytes[..];
                let mut ok = true;
                while !rest.is_empty() && ok {
                    let before = rest.len();
                    ok = match prost::encoding::decode_varint(&mut rest) {
                        Ok(v) => before - rest.len() == prost::encoding::encoded_len_varint(v),
                        Err(_) => false,
                    };
                }
                ok.then(|| prost_values(&bytes).len())
            };
            assert_eq!(varint_count(&bytes), canonical, "{bytes:02x?}");
        }
    }
}
