//! The descriptor compatibility check: today's `proto/` against the
//! descriptors of every release checked into `crates/protocol/golden/`
//! (docs/compatibility.md).
//!
//! [`breaking_changes`] follows the spirit of `buf breaking`'s WIRE rules,
//! over the `FileDescriptorSet`s protox compiles: for every message of the
//! release (nested ones included) it reports a message that disappeared; a
//! field whose number, type (scalar kind, or message/enum type name), label
//! (singular, `optional`, `repeated`) or oneof changed; a field that
//! disappeared without its number being `reserved`; and for every enum a
//! value whose number changed, or that disappeared without its number being
//! reserved. It is stricter than buf in one way: any type change is
//! reported, even between wire-compatible scalars (`int32` and `int64`),
//! because our decoders check values, not just the wire.
//!
//! Adding messages, fields, enum values and oneof members, and renaming a
//! field in place (same number, type, label), are allowed. Two changes the
//! wire cannot see are allowed too, as protobuf's own compatibility rules
//! allow them: a message or enum that moved to another package under the
//! same name (the wire carries no names; its fields and values are then
//! checked where it went), and a field retyped from an embedded message to
//! `bytes` (both are length-delimited; the bytes hold the encoded message,
//! which is how the compute protocol came to carry dataflow descriptions it
//! does not read: `Export.description` was `lockstep.compute.v1.Plan plan`).
//! A third: a packed `repeated int64` retyped to singular `bytes` (the bytes
//! are the packed varints; every sender of a release, prost, packs), which
//! is how rows became their family's bytes (`Update.row`, `Row.values`).

mod common;

use std::collections::BTreeMap;

use prost::Message as _;
use protox::prost_reflect::prost_types::{
    field_descriptor_proto::{Label, Type},
    DescriptorProto, EnumDescriptorProto, FieldDescriptorProto, FileDescriptorSet,
};

/// Every message of `set` by full name (`.package.Outer.Inner`).
fn messages(set: &FileDescriptorSet) -> BTreeMap<String, &DescriptorProto> {
    fn walk<'a>(
        prefix: &str,
        m: &'a DescriptorProto,
        out: &mut BTreeMap<String, &'a DescriptorProto>,
    ) {
        let name = format!("{prefix}.{}", m.name());
        for nested in &m.nested_type {
            walk(&name, nested, out);
        }
        out.insert(name, m);
    }
    let mut out = BTreeMap::new();
    for file in &set.file {
        let prefix = if file.package().is_empty() {
            String::new()
        } else {
            format!(".{}", file.package())
        };
        for m in &file.message_type {
            walk(&prefix, m, &mut out);
        }
    }
    out
}

/// Every enum of `set` by full name, nested ones included.
fn enums(set: &FileDescriptorSet) -> BTreeMap<String, &EnumDescriptorProto> {
    fn walk<'a>(
        prefix: &str,
        m: &'a DescriptorProto,
        out: &mut BTreeMap<String, &'a EnumDescriptorProto>,
    ) {
        let name = format!("{prefix}.{}", m.name());
        for e in &m.enum_type {
            out.insert(format!("{name}.{}", e.name()), e);
        }
        for nested in &m.nested_type {
            walk(&name, nested, out);
        }
    }
    let mut out = BTreeMap::new();
    for file in &set.file {
        let prefix = if file.package().is_empty() {
            String::new()
        } else {
            format!(".{}", file.package())
        };
        for e in &file.enum_type {
            out.insert(format!("{prefix}.{}", e.name()), e);
        }
        for m in &file.message_type {
            walk(&prefix, m, &mut out);
        }
    }
    out
}

/// A field's label as the wire sees it: proto3 `optional` (presence) is a
/// label of its own.
fn label(f: &FieldDescriptorProto) -> &'static str {
    match (f.label(), f.proto3_optional()) {
        (Label::Repeated, _) => "repeated",
        (Label::Required, _) => "required",
        (_, true) => "optional",
        (Label::Optional, false) => "singular",
    }
}

/// A field's type: the scalar kind, or the message or enum it names.
fn type_of(f: &FieldDescriptorProto) -> String {
    match f.r#type() {
        Type::Message | Type::Enum | Type::Group => {
            format!("{:?} {}", f.r#type(), f.type_name())
        }
        other => format!("{other:?}"),
    }
}

/// The oneof a field belongs to (by name), unless it is a proto3 `optional`
/// (whose synthetic oneof is its label, compared by [`label`]).
fn oneof_of(m: &DescriptorProto, f: &FieldDescriptorProto) -> Option<String> {
    if f.proto3_optional() {
        return None;
    }
    let index = usize::try_from(f.oneof_index?).ok()?;
    Some(m.oneof_decl.get(index)?.name().to_string())
}

fn reserved_field(m: &DescriptorProto, number: i32) -> bool {
    // Message reserved ranges are [start, end).
    m.reserved_range
        .iter()
        .any(|r| r.start() <= number && number < r.end())
}

fn reserved_value(e: &EnumDescriptorProto, number: i32) -> bool {
    // Enum reserved ranges are [start, end], both inclusive.
    e.reserved_range
        .iter()
        .any(|r| r.start() <= number && number <= r.end())
}

/// Where a message or enum named `name` (`.package.Name`) of a release is
/// today: under the same full name, or else the one of that short name in
/// another package, if exactly one exists.
fn find_moved<'a, T>(all: &'a BTreeMap<String, &'a T>, name: &str) -> Option<&'a T> {
    if let Some(found) = all.get(name) {
        return Some(found);
    }
    let short = name.rsplit('.').next()?;
    let mut same = all
        .iter()
        .filter(|(n, _)| n.rsplit('.').next() == Some(short))
        .map(|(_, t)| *t);
    match (same.next(), same.next()) {
        (Some(one), None) => Some(one),
        _ => None,
    }
}

/// The type name without its package, for comparing types that moved.
fn short_type(t: &str) -> &str {
    t.rsplit('.').next().unwrap_or(t)
}

/// Whether `old` and `new`, two field types, are the same on the wire: equal,
/// the same message or enum moved to another package, or an embedded message
/// that became `bytes`.
fn same_wire_type(old: &FieldDescriptorProto, new: &FieldDescriptorProto) -> bool {
    let (o, n) = (type_of(old), type_of(new));
    o == n
        || (old.r#type() == new.r#type()
            && matches!(old.r#type(), Type::Message | Type::Enum)
            && short_type(old.type_name()) == short_type(new.type_name()))
        || (old.r#type() == Type::Message && new.r#type() == Type::Bytes)
        || packed_to_bytes(old, new)
}

/// Whether `old` is a packed `repeated int64` and `new` a singular `bytes`:
/// the bytes hold the packed varints, so the wire does not change.
fn packed_to_bytes(old: &FieldDescriptorProto, new: &FieldDescriptorProto) -> bool {
    let packed = old.options.as_ref().and_then(|o| o.packed) != Some(false);
    old.r#type() == Type::Int64
        && label(old) == "repeated"
        && packed
        && new.r#type() == Type::Bytes
        && label(new) == "singular"
}

/// The wire-breaking differences from `old` (a release) to `new` (today),
/// one sentence each, naming the message or enum and the field or value.
fn breaking_changes(old: &FileDescriptorSet, new: &FileDescriptorSet) -> Vec<String> {
    let mut out = Vec::new();
    let new_messages = messages(new);
    for (name, om) in messages(old) {
        let Some(nm) = find_moved(&new_messages, &name) else {
            out.push(format!("message {name} disappeared"));
            continue;
        };
        let by_number: BTreeMap<i32, &FieldDescriptorProto> =
            nm.field.iter().map(|f| (f.number(), f)).collect();
        for of in &om.field {
            let field = format!("{name}.{} (number {})", of.name(), of.number());
            if let Some(nf) = nm.field.iter().find(|f| f.name() == of.name()) {
                if nf.number() != of.number() {
                    out.push(format!(
                        "field {field} changed number from {} to {}",
                        of.number(),
                        nf.number()
                    ));
                    // The number's own fate is reported below.
                }
            }
            let Some(nf) = by_number.get(&of.number()) else {
                if !reserved_field(nm, of.number()) {
                    out.push(format!(
                        "field {field} disappeared without its number being reserved"
                    ));
                }
                continue;
            };
            if !same_wire_type(of, nf) {
                out.push(format!(
                    "field {field} changed type from {} to {}",
                    type_of(of),
                    type_of(nf)
                ));
            }
            if label(of) != label(nf) && !packed_to_bytes(of, nf) {
                out.push(format!(
                    "field {field} changed label from {} to {}",
                    label(of),
                    label(nf)
                ));
            }
            let (oo, no) = (oneof_of(om, of), oneof_of(nm, nf));
            if oo != no {
                out.push(format!(
                    "field {field} moved from oneof {oo:?} to oneof {no:?}"
                ));
            }
        }
    }
    let new_enums = enums(new);
    for (name, oe) in enums(old) {
        let Some(ne) = find_moved(&new_enums, &name) else {
            out.push(format!("enum {name} disappeared"));
            continue;
        };
        for ov in &oe.value {
            let value = format!("{name}.{} (number {})", ov.name(), ov.number());
            if let Some(nv) = ne.value.iter().find(|v| v.name() == ov.name()) {
                if nv.number() != ov.number() {
                    out.push(format!(
                        "enum value {value} changed number from {} to {}",
                        ov.number(),
                        nv.number()
                    ));
                }
            }
            if !ne.value.iter().any(|v| v.number() == ov.number())
                && !reserved_value(ne, ov.number())
            {
                out.push(format!(
                    "enum value {value} disappeared without its number being reserved"
                ));
            }
        }
    }
    out
}

fn todays_descriptors() -> FileDescriptorSet {
    common::todays_compiler().file_descriptor_set()
}

fn release_descriptors(release: &str) -> FileDescriptorSet {
    FileDescriptorSet::decode(common::release_descriptor_bytes(release).as_slice())
        .expect("a FileDescriptorSet")
}

/// Today's `proto/` breaks nothing a v0.2.0 process or client relies on.
#[test]
fn todays_protos_are_wire_compatible_with_v0_2_0() {
    let old = release_descriptors("v0.2.0");
    // The snapshot holds both APIs, so the check has something to compare.
    let names = messages(&old);
    assert!(names.contains_key(".lockstep.compute.v1.Hello"));
    assert!(names.contains_key(".lockstep.environment.v1.ReplicaProcess"));
    let breaks = breaking_changes(&old, &todays_descriptors());
    assert!(
        breaks.is_empty(),
        "proto/ breaks the wire of release v0.2.0:\n{}",
        breaks.join("\n")
    );
}

fn message_mut<'a>(set: &'a mut FileDescriptorSet, name: &str) -> &'a mut DescriptorProto {
    set.file
        .iter_mut()
        .flat_map(|f| f.message_type.iter_mut())
        .find(|m| m.name() == name)
        .unwrap_or_else(|| panic!("no message {name}"))
}

fn field_mut<'a>(m: &'a mut DescriptorProto, name: &str) -> &'a mut FieldDescriptorProto {
    m.field
        .iter_mut()
        .find(|f| f.name() == name)
        .unwrap_or_else(|| panic!("no field {name}"))
}

/// The check can fail: each planted break is reported, naming its message
/// and field (or enum and value).
#[test]
fn planted_breaks_are_each_reported() {
    let old = todays_descriptors();
    assert_eq!(breaking_changes(&old, &old), Vec::<String>::new());

    let renumbered = {
        let mut new = old.clone();
        field_mut(message_mut(&mut new, "Hello"), "epoch").number = Some(20);
        new
    };
    let retyped = {
        let mut new = old.clone();
        field_mut(message_mut(&mut new, "Peek"), "timestamp").r#type = Some(Type::String as i32);
        new
    };
    let other_message = {
        let mut new = old.clone();
        field_mut(message_mut(&mut new, "CreateDataflow"), "dataflow").type_name =
            Some(".lockstep.compute.v1.Peek".to_string());
        new
    };
    let relabeled = {
        let mut new = old.clone();
        field_mut(message_mut(&mut new, "Status"), "applied_seqno").label =
            Some(Label::Repeated as i32);
        new
    };
    let removed = {
        let mut new = old.clone();
        message_mut(&mut new, "Status")
            .field
            .retain(|f| f.name() != "installed");
        new
    };
    let enum_renumbered = {
        let mut new = old.clone();
        let e = new
            .file
            .iter_mut()
            .flat_map(|f| f.enum_type.iter_mut())
            .find(|e| e.name() == "ErrorKind")
            .expect("ErrorKind");
        e.value
            .iter_mut()
            .find(|v| v.name() == "ERROR_KIND_STALE_EPOCH")
            .expect("STALE_EPOCH")
            .number = Some(42);
        new
    };
    let cases = [
        (
            "renumbered",
            renumbered,
            "field .lockstep.compute.v1.Hello.epoch (number 2) changed number from 2 to 20",
        ),
        (
            "retyped",
            retyped,
            "field .lockstep.compute.v1.Peek.timestamp (number 3) changed type from Uint64 to String",
        ),
        (
            "retyped to another message",
            other_message,
            "field .lockstep.compute.v1.CreateDataflow.dataflow (number 1) changed type from Message .lockstep.compute.v1.DataflowDescription to Message .lockstep.compute.v1.Peek",
        ),
        (
            "relabeled",
            relabeled,
            "field .lockstep.compute.v1.Status.applied_seqno (number 4) changed label from singular to repeated",
        ),
        (
            "removed",
            removed,
            "field .lockstep.compute.v1.Status.installed (number 7) disappeared without its number being reserved",
        ),
        (
            "enum renumbered",
            enum_renumbered,
            "enum value .lockstep.compute.v1.ErrorKind.ERROR_KIND_STALE_EPOCH (number 2) changed number from 2 to 42",
        ),
    ];
    for (what, new, expected) in cases {
        let breaks = breaking_changes(&old, &new);
        assert!(
            breaks.iter().any(|b| b == expected),
            "{what}: expected {expected:?} among {breaks:#?}"
        );
    }
}

/// What the rules allow: a new field, a field removed with its number
/// reserved, a renamed field, a new enum value.
#[test]
fn additions_and_reserved_removals_pass() {
    let old = todays_descriptors();
    let mut new = old.clone();
    let status = message_mut(&mut new, "Status");
    let installed = status
        .field
        .iter()
        .position(|f| f.name() == "installed")
        .expect("installed");
    let mut added = status.field.remove(installed);
    status.reserved_range.push(
        protox::prost_reflect::prost_types::descriptor_proto::ReservedRange {
            start: Some(7),
            end: Some(8),
        },
    );
    added.name = Some("installed_now".to_string());
    added.number = Some(99);
    status.field.push(added);
    field_mut(message_mut(&mut new, "Peek"), "timestamp").name = Some("at".to_string());
    let e = new
        .file
        .iter_mut()
        .flat_map(|f| f.enum_type.iter_mut())
        .find(|e| e.name() == "ErrorKind")
        .expect("ErrorKind");
    let mut value = e.value[0].clone();
    value.name = Some("ERROR_KIND_NEW".to_string());
    value.number = Some(100);
    e.value.push(value);
    assert_eq!(breaking_changes(&old, &new), Vec::<String>::new());
}

/// The packed-`int64`-to-`bytes` allowance is that change only: the same
/// field made `repeated bytes`, or an unpacked `repeated int64` made
/// `bytes`, is still reported against v0.2.0.
#[test]
fn rows_as_bytes_are_allowed_only_from_packed_int64_to_singular_bytes() {
    let old = release_descriptors("v0.2.0");
    let mut repeated = todays_descriptors();
    field_mut(message_mut(&mut repeated, "Update"), "row").label = Some(Label::Repeated as i32);
    assert_eq!(
        breaking_changes(&old, &repeated),
        vec![
            "field .lockstep.compute.v1.Update.row (number 1) changed type from Int64 to Bytes"
                .to_string()
        ]
    );
    let mut unpacked = old.clone();
    field_mut(message_mut(&mut unpacked, "Update"), "row")
        .options
        .get_or_insert_with(Default::default)
        .packed = Some(false);
    let breaks = breaking_changes(&unpacked, &todays_descriptors());
    assert!(
        breaks.contains(
            &"field .lockstep.compute.v1.Update.row (number 1) changed type from Int64 to Bytes"
                .to_string()
        ),
        "{breaks:?}"
    );
}
