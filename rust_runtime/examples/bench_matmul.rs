//! The matmul timing that benchmarks/batch_invariance_cost.py reads (a benchmark tool, kept out of
//! the shipped extension: `gemm` is only a dev-dependency):
//!
//! `cargo run --release --example bench_matmul -- KERNEL THREADS REPEATS W.f32 OUT INP X.f32 M Y.f32`
//!
//! y = x · wᵀ for w float32 [OUT, INP] and x float32 [M, INP] (raw little-endian files, row-major,
//! e.g. numpy's `tofile`), run REPEATS times on a pool of THREADS threads. KERNEL: "packed", the
//! serving f32 matmul (w packed once, before the timing; batch-invariant), or "gemm", the gemm
//! crate as candle's f32 matmul calls it (blocking and threading picked by shape). Writes y
//! float32 [M, OUT] to Y.f32 and prints the wall seconds of each repeat as one JSON list.
use rust_runtime::kernels::{PackedF32, Par};
use std::time::Instant;

fn read_f32(path: &str, len: usize, name: &str) -> Result<Vec<f32>, String> {
    let bytes = std::fs::read(path).map_err(|e| format!("{name}: cannot read {path}: {e}"))?;
    if bytes.len() != len * 4 {
        return Err(format!("{name}: {path} holds {} bytes; expected {} ({len} float32)", bytes.len(), len * 4));
    }
    Ok(bytes.chunks_exact(4).map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]])).collect())
}

fn arg(args: &[String], i: usize, name: &str) -> Result<usize, String> {
    let v = args.get(i).ok_or_else(|| format!("missing {name}"))?;
    v.parse::<usize>().ok().filter(|&n| n >= 1).ok_or_else(|| format!("{name} is {v:?}; expected an integer >= 1"))
}

fn main() -> Result<(), String> {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let usage = "usage: bench_matmul packed|gemm THREADS REPEATS W.f32 OUT INP X.f32 M Y.f32";
    if args.len() != 9 {
        return Err(usage.into());
    }
    let kernel = args[0].as_str();
    if kernel != "packed" && kernel != "gemm" {
        return Err(format!("kernel is {kernel:?}; expected \"packed\" or \"gemm\" ({usage})"));
    }
    let (threads, repeats) = (arg(&args, 1, "THREADS")?, arg(&args, 2, "REPEATS")?);
    let (out, inp, m) = (arg(&args, 4, "OUT")?, arg(&args, 5, "INP")?, arg(&args, 7, "M")?);
    let w = read_f32(&args[3], out * inp, "W")?;
    let x = read_f32(&args[6], m * inp, "X")?;
    let par = Par::new(threads).map_err(|e| e.to_string())?;
    let packed = (kernel == "packed").then(|| PackedF32::pack(&w, out, inp));
    let mut y = vec![0f32; m * out];
    let mut secs = Vec::with_capacity(repeats);
    for _ in 0..repeats {
        let t0 = Instant::now();
        par.install(|| match &packed {
            Some(p) => p.matmul(&par, &x, m, &mut y),
            // SAFETY: dst m × out (row stride out), lhs x m × inp (row stride inp), rhs wᵀ
            // inp × out (element (i, r) = w[r·inp + i]): all in bounds of their Vecs.
            None => unsafe {
                gemm::gemm(
                    m,
                    out,
                    inp,
                    y.as_mut_ptr(),
                    1,
                    out as isize,
                    false,
                    x.as_ptr(),
                    1,
                    inp as isize,
                    w.as_ptr(),
                    inp as isize,
                    1,
                    0f32,
                    1f32,
                    false,
                    false,
                    false,
                    if threads > 1 { gemm::Parallelism::Rayon(threads) } else { gemm::Parallelism::None },
                )
            },
        });
        secs.push(t0.elapsed().as_secs_f64());
    }
    let bytes: Vec<u8> = y.iter().flat_map(|v| v.to_le_bytes()).collect();
    std::fs::write(&args[8], bytes).map_err(|e| format!("Y: cannot write {}: {e}", args[8]))?;
    println!("{}", serde_json::to_string(&secs).map_err(|e| e.to_string())?);
    Ok(())
}
