//! Runs the fuzz target's interpreter on random inputs, so the fuzz target cannot rot and its
//! checks run in every `make test`.

#[path = "support/wheel_ops.rs"]
mod wheel_ops;

#[test]
fn fuzz_interpreter_on_random_inputs() {
    let mut rng = fastrand::Rng::with_seed(0xf022);
    for _ in 0..3_000 {
        let len = rng.usize(0..400);
        let data: Vec<u8> = (0..len).map(|_| rng.u8(..)).collect();
        wheel_ops::run(&data);
    }
}

#[test]
fn fuzz_interpreter_edge_inputs() {
    wheel_ops::run(&[]);
    wheel_ops::run(&[0xff; 64]);
    wheel_ops::run(&[0; 64]);
    // Insert at u64::MAX, then poll to u64::MAX.
    let mut data = vec![0, 0, 3];
    data.extend_from_slice(&[0xff; 8]);
    data.extend_from_slice(&[4, 3]);
    data.extend_from_slice(&[0xff; 8]);
    wheel_ops::run(&data);
}
