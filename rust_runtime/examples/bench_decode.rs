//! Decode timing without Python: `cargo run --release --example bench_decode -- BUNDLE [threads] [none|q8_0|q4_0|q4_mix]`;
//! `-- prefill BUNDLE [threads] [tokens,...] [quantize]`: prefill time, best of 5 (the ids of benchmarks/prefill.py);
//! `-- gemv [threads] [m,m,...] [OUTxIN,...]`: the packed f32 matmul (default: the `small` and `base-400m`
//! shapes), GFLOP/s;
//! `-- linear [threads] [m,m,...] [OUTxIN,...] [kind,kind,...]`: `Linear::forward` time per call against the
//! batch rows m, f32 / q8_0 / q4_0 (GOP/s counts 2 per multiply-add, as GFLOP/s).
//! (set the thread count with CANDLE_NUM_THREADS / RAYON_NUM_THREADS too, before the first op).
use rust_runtime::{Model, Quantize};
use std::time::Instant;

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let args: Vec<String> = std::env::args().collect();
    if args.get(1).map(|s| s.as_str()) == Some("gemv") {
        let threads: usize = args.get(2).map(|s| s.parse()).transpose()?.unwrap_or(1);
        let ms: Vec<usize> = match args.get(3) {
            Some(s) => s.split(',').map(|v| v.parse()).collect::<Result<_, _>>()?,
            None => vec![1, 16, 64],
        };
        let shapes = parse_shapes(
            args.get(4),
            &[(32000, 512), (2560, 512), (1024, 512), (512, 1280), (2048, 1024), (8192, 1024), (1024, 4096)],
        )?;
        gemv_bench(threads, &ms, &shapes);
        return Ok(());
    }
    if args.get(1).map(|s| s.as_str()) == Some("prefill") {
        let dir = args.get(2).ok_or("usage: bench_decode prefill BUNDLE [threads] [tokens,tokens,...]")?;
        let threads: usize = args.get(3).map(|s| s.parse()).transpose()?.unwrap_or(1);
        let lens: Vec<usize> = match args.get(4) {
            Some(s) => s.split(',').map(|v| v.parse()).collect::<Result<_, _>>()?,
            None => vec![64, 512],
        };
        let q = Quantize::parse(args.get(5).map(|s| s.as_str()))?;
        let model = Model::load(std::path::Path::new(dir), q, threads)?;
        for &n in &lens {
            let ids: Vec<u32> = (0..n).map(|i| ((7 * i + 3) % 30000 + 2) as u32).collect();
            let mut best = f64::INFINITY;
            for _ in 0..5 {
                let mut cache = model.new_cache();
                let t = Instant::now();
                model.forward(&mut cache, &ids, false)?;
                best = best.min(t.elapsed().as_secs_f64());
            }
            println!("prefill {n} tokens, {}, threads={threads}: best of 5 {:.1} ms", q.name(), best * 1e3);
        }
        return Ok(());
    }
    if args.get(1).map(|s| s.as_str()) == Some("linear") {
        let threads: usize = args.get(2).map(|s| s.parse()).transpose()?.unwrap_or(1);
        let ms: Vec<usize> = match args.get(3) {
            Some(s) => s.split(',').map(|v| v.parse()).collect::<Result<_, _>>()?,
            None => vec![1, 2, 4, 8, 16, 32, 64],
        };
        let shapes = parse_shapes(args.get(4), &[(32000, 512), (2560, 512), (1024, 512), (512, 1280)])?;
        let kinds: Vec<Quantize> = match args.get(5) {
            Some(s) => s.split(',').map(|v| Quantize::parse(Some(v))).collect::<Result<_, _>>()?,
            None => vec![Quantize::None, Quantize::Q8_0, Quantize::Q4_0],
        };
        linear_bench(threads, &ms, &shapes, &kinds);
        return Ok(());
    }
    let dir = args.get(1).ok_or("usage: bench_decode BUNDLE [threads] [none|q8_0|q4_0|q4_mix]")?;
    let threads: usize = args.get(2).map(|s| s.parse()).transpose()?.unwrap_or(1);
    let q = Quantize::parse(args.get(3).map(|s| s.as_str()))?;
    let model = Model::load(std::path::Path::new(dir), q, threads)?;
    let prompt: Vec<u32> = (5..21).collect();
    for _ in 0..3 {
        let mut cache = model.new_cache();
        let t0 = Instant::now();
        let mut logits = model.forward(&mut cache, &prompt, false)?;
        let t1 = Instant::now();
        let n = 128;
        for _ in 0..n {
            let tok = rust_runtime::sampling::argmax(&logits).unwrap_or(0);
            logits = model.forward(&mut cache, &[tok as u32], false)?;
        }
        let t2 = Instant::now();
        println!(
            "{} threads={threads}: prefill {} tokens {:.1} ms, decode {:.0} tok/s",
            q.name(),
            prompt.len(),
            (t1 - t0).as_secs_f64() * 1e3,
            n as f64 / (t2 - t1).as_secs_f64()
        );
    }
    Ok(())
}

#[allow(dead_code)]
pub fn gemv_bench(threads: usize, ms: &[usize], shapes: &[(usize, usize)]) {
    use rust_runtime::kernels::{PackedF32, Par};
    let par = Par::new(threads).expect("a pool");
    for &(rows, k) in shapes {
        let w: Vec<f32> = (0..rows * k).map(|i| (i % 13) as f32 * 0.1).collect();
        let p = PackedF32::pack(&w, rows, k);
        for &m in ms {
            let x: Vec<f32> = (0..m * k).map(|i| (i % 7) as f32).collect();
            let mut y = vec![0f32; m * rows];
            // the best of 7 batches: this shared VM's speed drifts, a mean would mix in its neighbours
            let reps = (60_000_000 / (rows * k * m)).max(1);
            par.install(|| p.matmul(&par, &x, m, &mut y));
            let mut dt = f64::INFINITY;
            for _ in 0..7 {
                let t = Instant::now();
                for _ in 0..reps {
                    par.install(|| p.matmul(&par, &x, m, &mut y));
                }
                dt = dt.min(t.elapsed().as_secs_f64() / reps as f64);
            }
            println!(
                "matmul {m}x{k} · {k}x{rows}: {:.1} us, {:.1} GB/s of weights, {:.1} GFLOP/s",
                dt * 1e6,
                (rows * k * 4) as f64 / dt / 1e9,
                (2 * m * rows * k) as f64 / dt / 1e9
            );
        }
    }
}

/// Seconds of CPU time the calling thread has used.
fn thread_cpu_s() -> f64 {
    let mut ts = libc::timespec { tv_sec: 0, tv_nsec: 0 };
    // SAFETY: clock_gettime writes the timespec it is given.
    unsafe { libc::clock_gettime(libc::CLOCK_THREAD_CPUTIME_ID, &mut ts) };
    ts.tv_sec as f64 + ts.tv_nsec as f64 * 1e-9
}

/// `OUTxIN,OUTxIN,...`, or `default` when absent.
fn parse_shapes(
    arg: Option<&String>,
    default: &[(usize, usize)],
) -> Result<Vec<(usize, usize)>, Box<dyn std::error::Error>> {
    match arg {
        Some(s) => s
            .split(',')
            .map(|v| {
                let (r, k) = v.split_once('x').ok_or("shapes: OUTxIN,OUTxIN,...")?;
                Ok((r.parse()?, k.parse()?))
            })
            .collect(),
        None => Ok(default.to_vec()),
    }
}

/// y = x·Wᵀ through `Linear` (f32 packed, or a block kind for every row) at each shape and m: the
/// time per call (best of 5 batches) and its ratio to the first m.
pub fn linear_bench(threads: usize, ms: &[usize], shapes: &[(usize, usize)], kinds: &[Quantize]) {
    use rust_runtime::kernels::Par;
    use rust_runtime::linear::{Linear, Part};
    use rust_runtime::quant::Role;
    let par = Par::new(threads).expect("a pool");
    for &(rows, k) in shapes {
        let w: Vec<f32> = (0..rows * k).map(|i| ((i * 7919) % 2001) as f32 * 1e-3 - 1.0).collect();
        for q in kinds {
            let part = Part { name: "bench".into(), w: w.clone(), rows, kind: q.storage(Role::QProj) };
            let lin = Linear::new(vec![part], k, &par).expect("a linear");
            let mut base = 0.0;
            for &m in ms {
                let x: Vec<f32> = (0..m * k).map(|i| ((i * 31) % 17) as f32 * 0.1 - 0.8).collect();
                let mut y = vec![0f32; m * rows];
                par.install(|| lin.forward(&par, &x, m, &mut y)).unwrap();
                let reps = (100_000_000 / (rows * k * m.min(8))).max(2);
                let mut dt = f64::INFINITY;
                let mut cpu = f64::INFINITY;
                for _ in 0..5 {
                    let (t, c) = (Instant::now(), thread_cpu_s());
                    for _ in 0..reps {
                        par.install(|| lin.forward(&par, &x, m, &mut y)).unwrap();
                    }
                    dt = dt.min(t.elapsed().as_secs_f64() / reps as f64);
                    cpu = cpu.min((thread_cpu_s() - c) / reps as f64);
                }
                if base == 0.0 {
                    base = dt;
                }
                // with one thread, the calling thread's CPU time leaves out the time other jobs took the core
                let cpu_gops =
                    if threads == 1 { format!("{:6.1}", (2 * m * rows * k) as f64 / cpu / 1e9) } else { "-".into() };
                println!(
                    "{:6} {m:3}x{k} · {k}x{rows}: {:9.1} us  x first {:6.2}  {:6.1} GOP/s ({cpu_gops} GOP/s of CPU time)  {:5.1} GB/s of weights",
                    q.name(),
                    dt * 1e6,
                    dt / base,
                    (2 * m * rows * k) as f64 / dt / 1e9,
                    lin.bytes() as f64 / dt / 1e9
                );
            }
        }
    }
}
