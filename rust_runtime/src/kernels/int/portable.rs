//! The integer register tile in portable code: the module's chain for any block kind.

use super::layout::{
    nibble, quant_at, BlockKind, Layout, Tile, GROUP, K_DMIN, K_HEADER, K_M, K_SC, Q4_BYTES, Q8_BYTES, QK, SCALES,
};
use half::f16;

/// The chain in portable code: per block the exact integer dot product, then the fma(s).
pub(super) unsafe fn tile_generic(kind: BlockKind, t: &Tile, n: usize) {
    let ubl = kind.unit_blocks();
    let f16_at = |p: *const u8| f16::from_le_bytes([*p, *p.add(1)]).to_f32();
    for tok in 0..n {
        let y = t.y.add(tok * GROUP);
        for rr in 0..GROUP {
            let mut acc = if t.resume { *y.add(rr) } else { 0.0 };
            for b in 0..t.blocks {
                let unit = t.w.add(b / ubl * t.stride);
                let j = b % ubl;
                let quants = match kind {
                    BlockKind::Q4K => std::slice::from_raw_parts(unit.add(K_HEADER + j * Q4_BYTES), Q4_BYTES),
                    BlockKind::Q4_0 => std::slice::from_raw_parts(unit.add(SCALES), Q4_BYTES),
                    BlockKind::Q8_0 => std::slice::from_raw_parts(unit.add(SCALES), Q8_BYTES),
                };
                let xb = std::slice::from_raw_parts(t.x.add(tok * t.xs + b * QK), QK);
                let mut isum = 0i32;
                for (i, &xv) in xb.iter().enumerate() {
                    let w = match kind {
                        BlockKind::Q8_0 => quants[quant_at(rr, i, false).0] as i32 - 128,
                        BlockKind::Q4_0 => nibble(quants, rr, i) as i32 - 8,
                        BlockKind::Q4K => nibble(quants, rr, i) as i32,
                    };
                    isum += w * xv as i32;
                }
                let dx = *t.dx.add(tok * t.ds + b);
                match kind {
                    BlockKind::Q4K => {
                        let ds = f16_at(unit.add(rr * 2)) * *unit.add(K_SC + j * GROUP + rr) as f32;
                        let dm = f16_at(unit.add(K_DMIN + rr * 2)) * *unit.add(K_M + j * GROUP + rr) as f32;
                        let sx = *t.sx.add(tok * t.ds + b) as f32;
                        acc = (isum as f32).mul_add(ds * dx, acc);
                        acc = (-sx).mul_add(dm * dx, acc);
                    }
                    _ => acc = (isum as f32).mul_add(f16_at(unit.add(rr * 2)) * dx, acc),
                }
            }
            *y.add(rr) = acc;
        }
    }
}
