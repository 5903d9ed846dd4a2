//! The packed layout of the integer kernels' weights (see `kernels::int`): rows in groups of 32, a
//! group's units of block scales and quants, where a row's quant sits, and `Tile`, one register
//! tile's operands, which every level's tiles (portable, x86, AMX) take.

pub use crate::kernels::qblocks::{BlockKind, QK};

/// Output rows per panel (one zmm of int32 sums).
pub(super) const PANEL: usize = 16;
/// Output rows per group (two panels): the unit a thread takes and a register tile covers.
pub const GROUP: usize = 32;
/// Bytes of a q8_0 / q4_0 unit's header, and of one 32-block's quants of a group.
pub(super) const SCALES: usize = GROUP * 2;
/// (q8_0's quants of a group's block: also the bytes AMX reads q4_0 unpacked to)
pub(super) const Q8_BYTES: usize = GROUP * QK;
pub(super) const Q4_BYTES: usize = GROUP * QK / 2;
/// q4_K header: d, dmin (f16 a row), then the 8 sub-blocks' scales and mins (a byte a row).
pub(super) const K_DMIN: usize = GROUP * 2;
pub(super) const K_SC: usize = GROUP * 4;
pub(super) const K_M: usize = K_SC + 8 * GROUP;
pub(super) const K_HEADER: usize = K_M + 8 * GROUP;

/// Layout facts of a block kind (see the module's doc).
pub(super) trait Layout {
    /// 32-blocks per unit.
    fn unit_blocks(self) -> usize;
    /// Bytes of one group's unit.
    fn unit_bytes(self) -> usize;
    /// The unsigned offset of the stored quants that the activations' sums undo (0: none).
    fn offset(self) -> i32;
}

impl Layout for BlockKind {
    fn unit_blocks(self) -> usize {
        self.block() / QK
    }
    fn unit_bytes(self) -> usize {
        match self {
            BlockKind::Q8_0 => SCALES + Q8_BYTES,
            BlockKind::Q4_0 => SCALES + Q4_BYTES,
            BlockKind::Q4K => K_HEADER + 8 * Q4_BYTES,
        }
    }
    fn offset(self) -> i32 {
        match self {
            BlockKind::Q8_0 => 128,
            BlockKind::Q4_0 => 8,
            BlockKind::Q4K => 0,
        }
    }
}

/// Bits a weight costs in memory, scales included: q8_0 8.5, q4_0 4.5, q4_K 4.625 (GGML's q4_K packs
/// its 6-bit scales into 4.5).
pub fn bits_per_weight(kind: BlockKind) -> f64 {
    (kind.unit_bytes() * 8) as f64 / (GROUP * kind.block()) as f64
}

/// Where row `rr` (0..32) of a group, at position i of a 32-block, sits among the block's quant
/// bytes: step s = i / 4 of panel rr / 16, lane rr % 16, byte i % 4 (q4: the pair of steps, and
/// whether it is the high nibble).
pub(super) fn quant_at(rr: usize, i: usize, four_bit: bool) -> (usize, bool) {
    let (p, lane, s, j) = (rr / PANEL, rr % PANEL, i / 4, i % 4);
    if four_bit {
        ((s / 2) * GROUP * 4 + p * PANEL * 4 + lane * 4 + j, s % 2 == 1)
    } else {
        (s * GROUP * 4 + p * PANEL * 4 + lane * 4 + j, false)
    }
}

/// Store the 4-bit quants `q` of row `rr` of a group's 32-block at `quants` (see `quant_at`).
pub(super) fn put_nibbles(quants: &mut [u8], rr: usize, q: &[u8; QK]) {
    for (i, &v) in q.iter().enumerate() {
        let (at, high) = quant_at(rr, i, true);
        quants[at] = if high { (quants[at] & 0x0F) | (v << 4) } else { (quants[at] & 0xF0) | (v & 0x0F) };
    }
}

/// The 4-bit quant of row `rr` at position i of a group's 32-block at `quants`.
pub(super) fn nibble(quants: &[u8], rr: usize, i: usize) -> u8 {
    let (at, high) = quant_at(rr, i, true);
    if high {
        quants[at] >> 4
    } else {
        quants[at] & 0x0F
    }
}

/// One register tile's operands: n ≤ TILE token rows × one group (32 rows), over `blocks`
/// 32-blocks (whole units) starting at the group's unit `w` (the next unit `stride` bytes on);
/// token t's quants at `x + t·xs`, its block sums and scales at `sx + t·ds`, `dx + t·ds`;
/// outputs (32 floats a token) at `y + t·GROUP`, resumed from the partial sums there when `resume`.
#[derive(Clone, Copy)]
pub(crate) struct Tile {
    pub(crate) w: *const u8,
    pub(crate) stride: usize,
    pub(crate) x: *const i8,
    pub(crate) xs: usize,
    pub(crate) sx: *const i32,
    pub(crate) dx: *const f32,
    pub(crate) ds: usize,
    pub(crate) blocks: usize,
    pub(crate) y: *mut f32,
    pub(crate) resume: bool,
}
