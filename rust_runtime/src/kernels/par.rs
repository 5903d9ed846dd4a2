//! `Par`, the per-model rayon pool that splits work by ranges (its threads pinned to CPUs), and the
//! per-thread scratch buffers the kernels reuse (`with_scratch`).

use std::cell::RefCell;
use std::ops::Range;

// ---------------------------------------------------------------- threads

/// How a model splits work. `threads == 1`: everything runs on the calling thread (so two
/// Python threads generating at once really run in parallel). `threads > 1`: the model owns a
/// rayon pool of that size; a whole forward runs inside it (`install`, one hand-off per call)
/// and row ranges are split with rayon's work stealing, so a worker that the OS has descheduled
/// (2 shared cores!) costs little: the thread that is running takes the remaining chunks.
/// (A spinning barrier, as candle's pool has, waiting on a preempted worker stalls every step on a
/// loaded 2-core VM.)
#[derive(Clone)]
pub struct Par {
    pub threads: usize,
    pool: Option<std::sync::Arc<rayon::ThreadPool>>,
}

impl std::fmt::Debug for Par {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "Par {{ threads: {} }}", self.threads)
    }
}

/// What each compute thread does as it starts: pin itself to one CPU of those this process may
/// run on (thread i to the i-th), when there are at least as many CPUs as threads and
/// `SHALIK_RUST_PIN` is not `0`; else nothing. onnxruntime pins its intra-op threads the same way.
///
/// Why: after the machine idled (a request after a pause), Linux woke both workers of a 2-thread
/// pool on the same CPU and moved one away only some milliseconds later, so a 64-token prefill of
/// base-400m took 81-91 ms after a 0.5 s pause against 64-67 back to back; pinned, 67-69.
fn pinning(threads: usize) -> impl Fn(usize) + Send + Sync + 'static {
    #[cfg(target_os = "linux")]
    let cpus: Vec<usize> = {
        // SAFETY: a zeroed cpu_set_t is a valid empty set; sched_getaffinity fills it
        let mut set: libc::cpu_set_t = unsafe { std::mem::zeroed() };
        let ok = unsafe { libc::sched_getaffinity(0, std::mem::size_of::<libc::cpu_set_t>(), &mut set) } == 0;
        let off = match std::env::var("SHALIK_RUST_PIN").unwrap_or_default().as_str() {
            "0" => true,
            "" | "1" => false,
            other => {
                eprintln!("rust_runtime: SHALIK_RUST_PIN={other:?} is not 0 or 1: threads pinned");
                false
            }
        };
        let all: Vec<usize> = if ok && !off {
            (0..libc::CPU_SETSIZE as usize).filter(|&c| unsafe { libc::CPU_ISSET(c, &set) }).collect()
        } else {
            vec![]
        };
        if all.len() >= threads {
            all
        } else {
            vec![]
        }
    };
    #[cfg(not(target_os = "linux"))]
    let cpus: Vec<usize> = {
        let _ = threads;
        vec![]
    };
    move |i| {
        #[cfg(target_os = "linux")]
        if let Some(&cpu) = cpus.get(i) {
            // SAFETY: as above; a failure leaves the thread where the scheduler puts it
            unsafe {
                let mut set: libc::cpu_set_t = std::mem::zeroed();
                libc::CPU_SET(cpu, &mut set);
                libc::sched_setaffinity(0, std::mem::size_of::<libc::cpu_set_t>(), &set);
            }
        }
        let _ = (&cpus, i);
    }
}

impl Par {
    pub fn new(threads: usize) -> crate::error::Result<Self> {
        let threads = threads.max(1);
        let pool = if threads > 1 {
            let p = rayon::ThreadPoolBuilder::new()
                .num_threads(threads)
                .thread_name(|i| format!("rust_runtime-{i}"))
                .start_handler(pinning(threads))
                .build()
                .map_err(|e| crate::error::Error::format(format!("cannot start {threads} compute threads: {e}")))?;
            Some(std::sync::Arc::new(p))
        } else {
            None
        };
        Ok(Par { threads, pool })
    }

    /// Run `f` inside this model's pool (or inline with one thread), the pool's other threads
    /// polling for its parallel work until `f` returns instead of sleeping between its regions.
    ///
    /// Why: a rayon worker sleeps soon after its last job, and waking it costs a futex and, on a
    /// virtual machine whose idle vCPU halted, a wake-up through the hypervisor (tens of µs, more
    /// after a pause, when the guest's halt polling has shrunk). A forward has some 10 parallel
    /// regions a layer with serial work between them, so the workers slept and were woken at
    /// almost each one: a 64-token prefill of base-400m took 106 ms after a 0.5 s pause against
    /// 81 ms back to back. onnxruntime's pool spins between regions in the same way.
    pub fn install<R: Send>(&self, f: impl FnOnce() -> R + Send) -> R {
        let Some(p) = &self.pool else { return f() };
        if p.current_thread_index().is_some() {
            return f(); // already inside (a nested install): the outer one keeps the workers polling
        }
        p.install(|| {
            let done = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
            // set even when f panics, so that no poller is left spinning
            struct Done(std::sync::Arc<std::sync::atomic::AtomicBool>);
            impl Drop for Done {
                fn drop(&mut self) {
                    self.0.store(true, std::sync::atomic::Ordering::Release);
                }
            }
            let _done = Done(done.clone());
            let me = rayon::current_thread_index();
            // one poller on each other thread of the pool (a broadcast job goes to every thread's own
            // queue: a plain spawned job could be taken back by f's thread while it waits in a region)
            p.spawn_broadcast(move |ctx| {
                // Not on f's thread, and never inside another poller: a poller that runs a job
                // which waits in a join may be handed the next call's poller, which would then
                // spin above the very job its call waits for. For the same reason a poller gives
                // up after POLL_IDLE without work (it may sit above a waiting job of a thread
                // that was not polling).
                if Some(ctx.index()) == me || POLLING.get() {
                    return;
                }
                POLLING.set(true);
                let mut idle: Option<std::time::Instant> = None;
                while !done.load(std::sync::atomic::Ordering::Acquire) {
                    if rayon::yield_now() == Some(rayon::Yield::Executed) {
                        idle = None;
                    } else if idle.get_or_insert_with(std::time::Instant::now).elapsed() > POLL_IDLE {
                        break;
                    } else {
                        std::hint::spin_loop();
                    }
                }
                POLLING.set(false);
            });
            f()
        })
    }

    /// Run `f` over `0..n_units` split into ranges, possibly on several threads. Call only from
    /// inside `install`. `f` must only write to memory owned by its own units.
    pub fn run(&self, n_units: usize, f: impl Fn(Range<usize>) + Sync + Send) {
        if n_units == 0 {
            return;
        }
        if self.pool.is_none() || n_units == 1 {
            f(0..n_units);
            return;
        }
        use rayon::prelude::*;
        let chunks = n_units.min(self.threads * 4);
        (0..chunks).into_par_iter().for_each(|c| f(c * n_units / chunks..(c + 1) * n_units / chunks));
    }

    /// `f(i, row)` for every row i of `out` (rows of `width` floats), split over the threads
    /// when there are more than `ROWS_PAR_FLOATS` floats (elementwise work below that is cheaper
    /// than a hand-off). Call only from inside `install`. Each row is computed the same way on
    /// any thread, so the result does not depend on the split.
    pub fn rows(&self, out: &mut [f32], width: usize, f: impl Fn(usize, &mut [f32]) + Sync + Send) {
        let m = if width == 0 { 0 } else { out.len() / width };
        if self.pool.is_none() || m * width < ROWS_PAR_FLOATS {
            for (i, row) in out.chunks_exact_mut(width.max(1)).take(m).enumerate() {
                f(i, row);
            }
            return;
        }
        let op = SyncPtr(out.as_mut_ptr());
        self.run(m, |range| {
            let op = op;
            for i in range {
                // SAFETY: row i is written by this unit only, and lies inside `out`.
                f(i, unsafe { std::slice::from_raw_parts_mut(op.0.add(i * width), width) });
            }
        });
    }

    /// Like `run` with one unit per item and a fallible body; the first error wins.
    pub fn try_each<E: Send>(&self, n: usize, f: impl Fn(usize) -> Result<(), E> + Sync + Send) -> Result<(), E> {
        if self.pool.is_none() || n <= 1 {
            return (0..n).try_for_each(f);
        }
        use rayon::prelude::*;
        (0..n).into_par_iter().try_for_each(f)
    }
}

thread_local! {
    /// Whether this thread runs a poller of `Par::install`.
    static POLLING: std::cell::Cell<bool> = const { std::cell::Cell::new(false) };
}

/// How long a poller of `Par::install` waits for work before it lets its thread sleep.
const POLL_IDLE: std::time::Duration = std::time::Duration::from_millis(1);

/// Below this many floats `Par::rows` runs on the calling thread.
const ROWS_PAR_FLOATS: usize = 1 << 15;

/// A raw pointer that may be shared between threads that write disjoint ranges.
#[derive(Clone, Copy)]
pub struct SyncPtr(pub *mut f32);
unsafe impl Send for SyncPtr {}
unsafe impl Sync for SyncPtr {}

/// Run `f` on this thread's scratch in `key` (a float vector, quantized activations, ...), or on a
/// fresh default one if the kept one is busy (a rayon job stolen while this thread waits inside a
/// parallel region can run another matmul here).
pub(crate) fn with_scratch<T: Default, R>(
    key: &'static std::thread::LocalKey<RefCell<T>>,
    f: impl FnOnce(&mut T) -> R,
) -> R {
    key.with(|cell| {
        let mut fresh = T::default();
        let mut kept = cell.try_borrow_mut();
        let buf = match kept.as_deref_mut() {
            Ok(b) => b,
            Err(_) => &mut fresh,
        };
        f(buf)
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn back_to_back_installs_with_parallel_regions_finish() {
        // each install starts pollers on the other threads; none may spin for good above a job that
        // the next install's work waits for (the first version, whose pollers spun until their own
        // call ended, hung the integer kernels' batch-invariance test; this loop guards that installs
        // finish, it did not reproduce that hang)
        let par = Par::new(2).unwrap();
        let (tx, rx) = std::sync::mpsc::channel();
        std::thread::spawn(move || {
            for _ in 0..3000 {
                par.install(|| {
                    par.run(64, |r| {
                        std::hint::black_box(r.map(|i| i as f64).sum::<f64>());
                    })
                });
            }
            tx.send(()).unwrap();
        });
        assert!(rx.recv_timeout(std::time::Duration::from_secs(60)).is_ok(), "3000 installs did not finish in 60 s");
    }
}
