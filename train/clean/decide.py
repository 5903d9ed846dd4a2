"""The central half of the cleaning stage: the validation split of whole works, deduplication, decontamination.

:class:`Cleaner` takes the workers' :class:`~train.clean.scan.CleanPart` s in reading order (documents of the
configured languages only) and keeps a small record per document in memory; signatures and 13-grams go to spill
files in a scratch folder, so memory stays bounded by the records. :meth:`Cleaner.decide` then returns one code
per document (:data:`TRAIN`, :data:`VAL` or a removal reason) and the report, in these steps:

1. **quality** — a document failing an enabled rule of ``rules.toml`` is removed (train or validation side);
2. **split** — per input file and language, the works (:mod:`train.clean.works`) in the order of their key's
   hash go to validation while at least half of each fits into ``val_fraction`` of that group's characters; a
   group with two works or more where none fits gives its smallest work. A work chosen in one group is
   validation everywhere, so no part of a validation work is trained on;
3. **exact_dup** — documents with the same normalised-text hash form a cluster; **near_dup** — documents sharing
   an LSH band key whose signatures agree on at least ``threshold`` of their values are joined (union-find;
   each candidate is compared with the first document of its band bucket, so the work is linear). A cluster
   keeps every validation member and drops its training members; without a validation member it keeps the first
   document in reading order. Nothing here depends on the number of workers;
4. **decontam** — a training document sharing an n-gram with an evaluation item (``decontam_eval``, found by
   the workers) or a 13-gram with a kept validation document (``decontam_val``) is removed.
"""

from __future__ import annotations

import time
from array import array
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from train.clean import quality
from train.clean.scan import CleanPart, Settings
from train.clean.works import work_order

TRAIN, VAL = 0, 1
REASONS = ("quality", "exact_dup", "near_dup", "decontam_val", "decontam_eval")  # codes 2, 3, ...
CODE = {r: i + 2 for i, r in enumerate(REASONS)}
EXAMPLES = 3


class _Spill:
    """Append-only arrays on disk (one dtype), read back as a memory map."""

    def __init__(self, path: Path, dtype):
        self.path, self.dtype = path, np.dtype(dtype)
        self._f = open(path, "wb")
        self.n = 0

    def write(self, a: np.ndarray) -> None:
        self._f.write(np.ascontiguousarray(a, dtype=self.dtype).tobytes())
        self.n += a.size

    def read(self) -> np.ndarray:
        self._f.close()
        if self.n == 0:
            return np.zeros(0, self.dtype)
        return np.memmap(self.path, dtype=self.dtype, mode="r", shape=(self.n,))


class _UnionFind:
    def __init__(self, n: int):
        self.p = np.arange(n, dtype=np.int64)

    def find(self, x: int) -> int:
        p = self.p
        r = x
        while p[r] != r:
            r = p[r]
        while p[x] != r:
            p[x], x = r, p[x]
        return r

    def union(self, a: int, b: int) -> None:
        ra, rb = self.find(a), self.find(b)
        if ra != rb:
            lo, hi = (ra, rb) if ra < rb else (rb, ra)
            self.p[hi] = lo  # the root is the lowest index: the first in reading order


@dataclass
class Cleaner:
    """Collects the records of the cleaning stage; see the module doc."""

    settings: Settings
    languages: list[str]
    val_fraction: float
    scratch: Path
    lang: array = field(default_factory=lambda: array("b"))
    group: array = field(default_factory=lambda: array("q"))
    source: array = field(default_factory=lambda: array("q"))
    work: array = field(default_factory=lambda: array("q"))
    chars: array = field(default_factory=lambda: array("q"))
    fails: array = field(default_factory=lambda: array("I"))
    eval_hit: array = field(default_factory=lambda: array("b"))
    text_hash: list = field(default_factory=list)
    bands: list = field(default_factory=list)
    seconds: float = 0.0

    def __post_init__(self) -> None:
        self.scratch.mkdir(parents=True, exist_ok=True)
        self.sigs = _Spill(self.scratch / "sigs.u32", np.uint32)
        self.grams = _Spill(self.scratch / "grams.u64", np.uint64)
        self.gram_counts = array("q")
        self.heads = _Spill(self.scratch / "heads.u8", np.uint8)
        self.head_ends = array("q")
        self.work_ids: dict[str, int] = {}
        self.source_ids: dict[str, int] = {}
        self.group_ids: dict[tuple, int] = {}
        self.clusters: dict[str, list[list[int]]] = {}  # reason → the clusters' members (document numbers)

    def __len__(self) -> int:
        return len(self.lang)

    def add(self, part: CleanPart, langs: list[str], sources: list[str], file_index: int, chars: list[int]) -> None:
        """Take one chunk's part; ``langs``/``sources``/``chars`` per document, ``file_index`` its input."""
        for lang, src, w, c in zip(langs, sources, part.works, chars):
            self.lang.append(self.languages.index(lang))
            self.group.append(self.group_ids.setdefault((file_index, lang), len(self.group_ids)))
            self.source.append(self.source_ids.setdefault(src, len(self.source_ids)))
            self.work.append(self.work_ids.setdefault(w, len(self.work_ids)))
            self.chars.append(c)
        for h in part.heads:
            b = np.frombuffer(h.encode("utf-8"), dtype=np.uint8)
            self.heads.write(b)
            self.head_ends.append(self.heads.n)
        self.fails.frombytes(part.fails.astype(np.uint32).tobytes())
        self.eval_hit.frombytes(part.eval_hit.astype(np.int8).tobytes())
        if self.settings.enabled:
            self.text_hash.append(part.text_hash)
            self.bands.append(part.bands)
            self.sigs.write(part.sigs.ravel())
            self.grams.write(part.grams)
        self.gram_counts.frombytes(part.gram_counts.astype(np.int64).tobytes())
        self.seconds += part.seconds

    def head(self, i: int, heads: np.ndarray) -> str:
        """The first characters of document ``i``."""
        a = self.head_ends[i - 1] if i else 0
        return bytes(heads[a:self.head_ends[i]]).decode("utf-8")

    # ------------------------------------------------------------------------------------------ decide

    def decide(self) -> tuple[np.ndarray, dict]:
        """``(codes int8 [documents], report dict)``; see the module doc."""
        s = self.settings
        n = len(self)
        times: dict[str, float] = {}
        codes = np.zeros(n, dtype=np.int8)
        chars = np.asarray(self.chars, dtype=np.int64)
        work = np.asarray(self.work, dtype=np.int64)
        group = np.asarray(self.group, dtype=np.int64)
        fails = np.asarray(self.fails, dtype=np.int64)
        first_rule = np.full(n, -1, dtype=np.int64)
        t = time.perf_counter()
        if s.enabled:
            on = fails & quality.enabled_mask(s.rules)
            for bit in range(len(quality.ALL) - 1, -1, -1):  # the first failing rule wins
                first_rule[(on >> bit) & 1 == 1] = bit
            codes[on != 0] = CODE["quality"]
        times["quality"] = time.perf_counter() - t
        t = time.perf_counter()
        val_works = self._choose_val_works(codes, chars, work, group)
        codes[(codes == TRAIN) & np.isin(work, val_works)] = VAL
        times["split"] = time.perf_counter() - t
        clusters: dict[str, Counter] = {"exact_dup": Counter(), "near_dup": Counter()}
        if s.enabled:
            t = time.perf_counter()
            th = np.concatenate(self.text_hash) if self.text_hash else np.zeros(0, np.uint64)
            if "exact_dup" not in s.off:
                self._exact(codes, th, clusters["exact_dup"])
            times["exact_dup"] = time.perf_counter() - t
            t = time.perf_counter()
            if "near_dup" not in s.off:
                self._near(codes, clusters["near_dup"])
            times["near_dup"] = time.perf_counter() - t
            t = time.perf_counter()
            if "decontam" not in s.off:
                self._decontam(codes)
            times["decontam"] = time.perf_counter() - t
        report = self._report(codes, first_rule, fails, clusters, times, val_works, work, group)
        return codes, report

    def _choose_val_works(self, codes, chars, work, group) -> np.ndarray:
        alive = codes == TRAIN
        keys = {i: k for k, i in self.work_ids.items()}
        chosen: set[int] = set()
        for g in range(len(self.group_ids)):
            mine = alive & (group == g)
            if not mine.any():
                continue
            ws, inv = np.unique(work[mine], return_inverse=True)
            wchars = np.bincount(inv, weights=chars[mine]).astype(np.int64)
            if len(ws) < 2:
                continue
            budget = self.val_fraction * int(wchars.sum())
            order = sorted(range(len(ws)), key=lambda j: work_order(keys[int(ws[j])]))
            taken = 0
            picked = []
            for j in order:
                if taken >= budget:
                    break
                if taken + wchars[j] / 2 <= budget:
                    picked.append(int(ws[j]))
                    taken += int(wchars[j])
            if not picked:
                j = min(order, key=lambda j: (wchars[j], order.index(j)))
                picked.append(int(ws[j]))
            chosen.update(picked)
        return np.array(sorted(chosen), dtype=np.int64)

    def _keep_cluster(self, codes: np.ndarray, members: np.ndarray, reason: str, sizes: Counter) -> None:
        """Drop the training members of one cluster (all but the first when none is validation)."""
        sizes[len(members)] += 1
        self.clusters.setdefault(reason, []).append(members.tolist())
        is_val = codes[members] == VAL
        drop = members[~is_val] if is_val.any() else members[1:]
        codes[drop] = CODE[reason]

    def _exact(self, codes: np.ndarray, th: np.ndarray, sizes: Counter) -> None:
        live = np.flatnonzero(codes <= VAL)
        order = live[np.argsort(th[live], kind="stable")]
        h = th[order]
        starts = np.flatnonzero(np.concatenate([[True], h[1:] != h[:-1]]))
        ends = np.append(starts[1:], len(order))
        for a, b in zip(starts.tolist(), ends.tolist()):
            if b - a > 1:
                self._keep_cluster(codes, np.sort(order[a:b]), "exact_dup", sizes)

    def _near(self, codes: np.ndarray, sizes: Counter) -> None:
        s = self.settings
        n = len(self)
        live = np.flatnonzero(codes <= VAL)
        if len(live) < 2:
            return
        bands = np.concatenate(self.bands).reshape(n, s.bands)
        sigs = self.sigs.read().reshape(n, s.num_perm)
        uf = _UnionFind(n)
        for b in range(s.bands):
            keys = bands[live, b]
            order = np.argsort(keys, kind="stable")
            k = keys[order]
            same = np.flatnonzero(k[1:] == k[:-1]) + 1  # positions whose key equals the previous one
            if len(same) == 0:
                continue
            starts = np.flatnonzero(np.concatenate([[True], k[1:] != k[:-1]]))
            first = starts[np.searchsorted(starts, same, side="right") - 1]
            a, c = live[order[first]], live[order[same]]
            est = (sigs[a] == sigs[c]).mean(axis=1)
            for x, y in zip(a[est >= s.threshold].tolist(), c[est >= s.threshold].tolist()):
                uf.union(x, y)
        roots = np.array([uf.find(int(i)) for i in live], dtype=np.int64)
        order = np.argsort(roots, kind="stable")
        r = roots[order]
        starts = np.flatnonzero(np.concatenate([[True], r[1:] != r[:-1]]))
        ends = np.append(starts[1:], len(order))
        for a, b in zip(starts.tolist(), ends.tolist()):
            if b - a > 1:
                self._keep_cluster(codes, np.sort(live[order[a:b]]), "near_dup", sizes)

    def _decontam(self, codes: np.ndarray) -> None:
        counts = np.asarray(self.gram_counts, dtype=np.int64)
        ends = np.cumsum(counts)
        starts = ends - counts
        grams = self.grams.read()
        val = np.flatnonzero(codes == VAL)
        table = np.unique(np.concatenate([np.asarray(grams[starts[i]:ends[i]]) for i in val])) if len(val) else \
            np.zeros(0, np.uint64)
        hit = np.frombuffer(self.eval_hit, dtype=np.int8).astype(bool) if len(self) else np.zeros(0, bool)
        codes[(codes == TRAIN) & hit] = CODE["decontam_eval"]  # the more specific reason first
        train = np.flatnonzero(codes == TRAIN)
        mask = np.uint64((1 << 24) - 1)
        bits = np.zeros(1 << 24, dtype=bool)
        bits[(table & mask).astype(np.int64)] = True
        block = 1 << 22
        i = 0
        while i < len(train) and len(table):  # blocks of documents, ~block 13-grams at a time
            j = i
            while j < len(train) and ends[train[j]] - starts[train[i]] < block:
                j += 1
            j = max(j, i + 1)
            docs = train[i:j]
            lo, hi = starts[docs[0]], ends[docs[-1]]
            block_grams = np.asarray(grams[lo:hi])
            inside = bits[(block_grams & mask).astype(np.int64)]  # a bitmap of the table's low bits first
            cand = np.flatnonzero(inside)
            if len(cand):
                at = np.minimum(np.searchsorted(table, block_grams[cand]), len(table) - 1)
                inside[cand] = table[at] == block_grams[cand]
            pos = np.concatenate([[0], np.cumsum(inside)])
            for d in docs.tolist():
                if pos[ends[d] - lo] > pos[starts[d] - lo]:
                    codes[d] = CODE["decontam_val"]
            i = j

    # ------------------------------------------------------------------------------------------ report

    def _report(self, codes, first_rule, fails, clusters, times, val_works, work, group) -> dict:
        langs = self.languages
        sources = {i: s for s, i in self.source_ids.items()}
        src = np.asarray(self.source, dtype=np.int64)
        chars = np.asarray(self.chars, dtype=np.int64)
        lang = np.frombuffer(self.lang, dtype=np.int8) if len(self) else np.zeros(0, np.int8)
        heads = self.heads.read()

        def table(mask) -> dict:
            out = {}
            for si in np.unique(src[mask]).tolist():
                for li in np.unique(lang[mask & (src == si)]).tolist():
                    m = mask & (src == si) & (lang == li)
                    out[f"{langs[li]}/{sources[si]}"] = {"docs": int(m.sum()), "chars": int(chars[m].sum())}
            return out

        def examples(mask) -> list[str]:
            return [self.head(int(i), heads) for i in np.flatnonzero(mask)[:EXAMPLES]]

        removed = {}
        for r in REASONS:
            if r == "quality":
                for bit, name in enumerate(quality.ALL):
                    m = (codes == CODE["quality"]) & (first_rule == bit)
                    if m.any():
                        removed[name] = {"by": table(m), "docs": int(m.sum()), "chars": int(chars[m].sum()),
                                         "examples": examples(m)}
                continue
            m = codes == CODE[r]
            if m.any():
                removed[r] = {"by": table(m), "docs": int(m.sum()), "chars": int(chars[m].sum()),
                              "examples": examples(m)}
        alone = {name: table((fails >> bit) & 1 == 1) for bit, name in enumerate(quality.ALL)} \
            if self.settings.enabled else {}
        kept = codes <= VAL
        split = {}
        for side, code in (("train", TRAIN), ("val", VAL)):
            m = codes == code
            split[side] = {"works": int(len(np.unique(work[m]))), "docs": int(m.sum()),
                           "chars": int(chars[m].sum()),
                           "by_lang": {lang_: {"works": int(len(np.unique(work[m & (lang == li)]))),
                                               "docs": int((m & (lang == li)).sum()),
                                               "chars": int(chars[m & (lang == li)].sum())}
                                       for li, lang_ in enumerate(langs)}}
        train_works = set(np.unique(work[codes == TRAIN]).tolist())
        return {
            "enabled": self.settings.enabled,
            "rules": self.settings.rules.as_dict() if self.settings.enabled else None,
            "off": list(self.settings.off),
            "near": self.settings.near_params(),
            "in": {"docs": len(self), "chars": int(chars.sum()), "by": table(np.ones(len(self), bool))},
            "kept": {"docs": int(kept.sum()), "chars": int(chars[kept].sum()), "by": table(kept)},
            "removed": removed,
            "would_fail_alone": alone,
            "clusters": {k: {str(size): n for size, n in sorted(v.items())} for k, v in clusters.items()},
            "split": split,
            "val_works_with_train_parts": len(set(val_works.tolist()) & train_works),
            "seconds": {"scan_in_workers": self.seconds, **times},
        }
