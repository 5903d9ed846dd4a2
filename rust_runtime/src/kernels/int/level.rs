//! The integer kernels' SIMD level on this CPU (AMX, AVX-512 VNNI, AVX2 or portable), detected once
//! under `SHALIK_RUST_SIMD`, and the per-vendor choices of the decode kernels (software prefetch,
//! groups streamed at once).

use crate::kernels::simd::{simd_cap, SimdCap};
use std::sync::OnceLock;

/// Whether the decode kernels (`x86::gemv_vnni`) add a software prefetch a few blocks ahead of
/// each of their streams: yes on Intel, where they were tuned with it; no on AMD, where the
/// hardware prefetchers alone stream faster (Zen 4, `bench_decode` `small`, interleaved: q4_mix
/// decode +7 % at one thread and +8 % at two, q4_0 +15 % at two). The results are the same
/// either way.
pub fn gemv_prefetch() -> bool {
    static PREFETCH: OnceLock<bool> = OnceLock::new();
    *PREFETCH.get_or_init(|| prefetch_for_vendor(&cpu_vendor()))
}

/// The software-prefetch choice of `gemv_prefetch` for a CPUID vendor string.
fn prefetch_for_vendor(vendor: &str) -> bool {
    vendor != "AuthenticAMD"
}

/// Whole groups (32 rows each) a one-token matmul (decode) streams at once on AVX-512 VNNI
/// (`x86::gemv_vnni`), each with its own accumulators: 4 on Intel, where the decode kernels were
/// tuned; 8 on AMD, where the longer run of independent `vpdpbusd` chains is faster (Zen 4,
/// `bench_decode linear`; benchmarks/results/decode.md). Each output is the same chain either way.
pub fn gemv_groups() -> usize {
    static GROUPS: OnceLock<usize> = OnceLock::new();
    *GROUPS.get_or_init(|| groups_for_vendor(&cpu_vendor()))
}

/// The choice of `gemv_groups` for a CPUID vendor string.
fn groups_for_vendor(vendor: &str) -> usize {
    if vendor == "AuthenticAMD" {
        8
    } else {
        4
    }
}

/// The CPUID vendor string ("GenuineIntel", "AuthenticAMD", …; "" off x86-64).
pub fn cpu_vendor() -> String {
    #[cfg(target_arch = "x86_64")]
    {
        let r = std::arch::x86_64::__cpuid(0); // leaf 0 exists on every x86-64 CPU
        let bytes: Vec<u8> = [r.ebx, r.edx, r.ecx].iter().flat_map(|v| v.to_le_bytes()).collect();
        String::from_utf8_lossy(&bytes).into_owned()
    }
    #[cfg(not(target_arch = "x86_64"))]
    String::new()
}

/// The integer kernels' SIMD level.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum IntLevel {
    /// Intel AMX-INT8 tiles (`amx`) for q8_0 and q4_0 at `AMX_MIN_TOKENS` tokens or more,
    /// AVX-512 VNNI otherwise (this level implies it).
    Amx,
    /// AVX-512 F + BW + VNNI (`vpdpbusd`) and F16C.
    Avx512Vnni,
    /// AVX2 + FMA + F16C (`vpmaddubsw`).
    Avx2,
    Generic,
}

/// The level the CPU runs, detected once, under `kernels::simd_cap` (`SHALIK_RUST_SIMD`; `avx512`:
/// no AMX).
pub fn int_level() -> IntLevel {
    static LEVEL: OnceLock<IntLevel> = OnceLock::new();
    *LEVEL.get_or_init(|| {
        let cap = match simd_cap() {
            SimdCap::Generic => IntLevel::Generic,
            SimdCap::Avx2 => IntLevel::Avx2,
            SimdCap::Avx512 => IntLevel::Avx512Vnni,
            SimdCap::None => IntLevel::Amx,
        };
        // int_levels() is fastest first and the enum's order is the same
        *int_levels().iter().find(|l| **l as u8 >= cap as u8).unwrap_or(&IntLevel::Generic)
    })
}

/// Every level this CPU can run, fastest first (the tests run each one).
pub fn int_levels() -> Vec<IntLevel> {
    let mut v = Vec::new();
    #[cfg(target_arch = "x86_64")]
    {
        use std::arch::is_x86_feature_detected as has;
        if has!("avx512f") && has!("avx512bw") && has!("avx512vnni") && has!("f16c") && has!("fma") {
            if super::amx::available() {
                v.push(IntLevel::Amx);
            }
            v.push(IntLevel::Avx512Vnni);
        }
        if has!("avx2") && has!("fma") && has!("f16c") {
            v.push(IntLevel::Avx2);
        }
    }
    v.push(IntLevel::Generic);
    v
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_decode_prefetch_is_left_to_the_hardware_on_amd_only() {
        assert!(!prefetch_for_vendor("AuthenticAMD"));
        assert!(prefetch_for_vendor("GenuineIntel"));
        #[cfg(target_arch = "x86_64")]
        {
            let v = cpu_vendor();
            assert_eq!(v.len(), 12, "{v:?}");
            assert_eq!(gemv_prefetch(), v != "AuthenticAMD");
        }
    }

    #[test]
    fn the_decode_streams_eight_groups_on_amd_and_four_elsewhere() {
        assert_eq!(groups_for_vendor("AuthenticAMD"), 8);
        assert_eq!(groups_for_vendor("GenuineIntel"), 4);
        assert_eq!(groups_for_vendor(""), 4);
        #[cfg(target_arch = "x86_64")]
        assert_eq!(gemv_groups(), if cpu_vendor() == "AuthenticAMD" { 8 } else { 4 });
    }
}
