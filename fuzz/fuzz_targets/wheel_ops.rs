#![no_main]

#[path = "../../tests/support/wheel_ops.rs"]
mod wheel_ops;

libfuzzer_sys::fuzz_target!(|data: &[u8]| wheel_ops::run(data));
