//! The SIMD level the f32 kernels run (AVX-512, AVX2 + FMA or portable), detected once at run time,
//! and the cap `SHALIK_RUST_SIMD` puts on it for the f32 and the integer kernels.

use std::sync::OnceLock;

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum SimdLevel {
    Avx512,
    Avx2Fma,
    Generic,
}

/// The cap `SHALIK_RUST_SIMD` puts on the kernels' SIMD level, read once for the f32 and the integer
/// kernels: `avx512` (no AMX), `avx2`, `generic`, or unset / empty (none). Any other value is named
/// on stderr as ignored.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum SimdCap {
    None,
    Avx512,
    Avx2,
    Generic,
}

pub fn simd_cap() -> SimdCap {
    static CAP: OnceLock<SimdCap> = OnceLock::new();
    *CAP.get_or_init(|| match std::env::var("SHALIK_RUST_SIMD").unwrap_or_default().as_str() {
        "" => SimdCap::None,
        "avx512" => SimdCap::Avx512,
        "avx2" => SimdCap::Avx2,
        "generic" => SimdCap::Generic,
        other => {
            eprintln!("rust_runtime: SHALIK_RUST_SIMD={other:?} is not one of avx512, avx2, generic: ignored");
            SimdCap::None
        }
    })
}

pub fn simd_level() -> SimdLevel {
    static LEVEL: OnceLock<SimdLevel> = OnceLock::new();
    *LEVEL.get_or_init(|| {
        #[cfg(target_arch = "x86_64")]
        {
            if simd_cap() == SimdCap::Generic {
                return SimdLevel::Generic;
            }
            if simd_cap() != SimdCap::Avx2 && std::arch::is_x86_feature_detected!("avx512f") {
                return SimdLevel::Avx512;
            }
            if std::arch::is_x86_feature_detected!("avx2") && std::arch::is_x86_feature_detected!("fma") {
                return SimdLevel::Avx2Fma;
            }
        }
        SimdLevel::Generic
    })
}
