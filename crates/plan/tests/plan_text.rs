//! The plan text syntax never panics, whatever the input, and what it
//! prints it parses back to the same plan.

mod arb;

use lockstep_plan::text::parse_plan;
use proptest::prelude::*;

/// Text made of the syntax's own pieces (so that the parser gets deep into
/// it), of arbitrary characters, and of multibyte whitespace.
fn plan_like() -> impl Strategy<Value = String> {
    let piece = prop_oneof![
        Just("get(".to_string()),
        Just("map(".to_string()),
        Just("filter(".to_string()),
        Just("join(".to_string()),
        Just("reduce(".to_string()),
        Just("arrange(".to_string()),
        Just("add(".to_string()),
        Just("mul(".to_string()),
        Just("sum(".to_string()),
        Just("count".to_string()),
        Just(")".to_string()),
        Just(",".to_string()),
        Just("[".to_string()),
        Just("]".to_string()),
        Just("#".to_string()),
        Just(" >= ".to_string()),
        Just("\u{a0}".to_string()),
        Just("\u{3000}".to_string()),
        "-?[0-9]{1,20}",
        any::<char>().prop_map(|c| c.to_string()),
    ];
    proptest::collection::vec(piece, 0..64).prop_map(|v| v.concat())
}

proptest! {
    #[test]
    fn arbitrary_text_is_a_plan_or_an_error(text in plan_like()) {
        let _ = parse_plan(&text);
    }

    #[test]
    fn arbitrary_unicode_is_a_plan_or_an_error(text in any::<String>()) {
        let _ = parse_plan(&text);
    }

    #[test]
    fn printed_plans_parse_back(plan in arb::plan()) {
        prop_assert_eq!(parse_plan(&plan.to_string()).unwrap(), plan);
    }
}
