"""llama.cpp as a backend: a GGUF file (written by :mod:`export.gguf`) run through llama-cpp-python.

A benchmark and test peer (benchmarks/decode.py, nll_quant.py, clients_llamacpp.py; tests/test_gguf.py), never a
serving backend of :func:`serve.load`: it implements the Sequence protocol of :mod:`serve.backends.base`
(``prefill`` / ``decode`` / ``position``) over llama.cpp's single KV cache. llama-cpp-python (the ``bench`` extra,
a source build) and ``gguf`` (the ``export`` extra) are imported only when a backend is made.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

__all__ = ["LlamaCppBackend", "LlamaCppSequence", "gguf_context_length"]


class LlamaCppSequence:
    """llama.cpp's single KV cache behind the serving Sequence protocol (``prefill``/``decode``/``position``).

    Creating one resets the backend's context: llama-cpp-python's ``Llama`` holds one sequence at a time.
    """

    def __init__(self, backend: LlamaCppBackend):
        self._b = backend
        backend.llm.reset()

    @property
    def position(self) -> int:
        return int(self._b.llm.n_tokens)

    def prefill(self, ids: list[int], all_logits: bool = False) -> np.ndarray:
        """Append ``ids`` (ints) to the cache; float32 logits ``[len(ids), V]`` (needs ``logits_all``) or ``[V]``."""
        llm = self._b.llm
        start = llm.n_tokens
        llm.eval([int(i) for i in ids])
        if all_logits:
            if not self._b.logits_all:
                raise ValueError("all_logits needs a backend made with logits_all=True")
            return np.array(llm.scores[start:llm.n_tokens], dtype=np.float32)
        if self._b.logits_all:
            return np.array(llm.scores[llm.n_tokens - 1], dtype=np.float32)
        return np.ctypeslib.as_array(llm._ctx.get_logits_ith(-1), shape=(self._b.vocab_size,)).copy()

    def decode(self, token_id: int) -> np.ndarray:
        """One cached step; float32 logits ``[V]``."""
        return self.prefill([token_id])


class LlamaCppBackend:
    """A GGUF file in llama.cpp through llama-cpp-python (a benchmark and test peer, never a serving backend).

    ``threads``: compute threads for prefill and decode (default llama.cpp's: all cores). ``n_ctx``: KV cache
    positions (default the model's context; llama.cpp allocates and clears all of it at load). ``logits_all`` keeps
    every position's logits (parity checks; costs an lm_head per prefill position). ``f32_cache`` stores K/V in
    float32 (llama.cpp's default f16 cache alone moves logits by ~3e-3, notes/rust-facts.md §8). ``extra_bufts=False``
    (default) turns off llama.cpp's extra weight buffer types (AMX and CPU repacking): on this machine the AMX
    path dies of SIGILL on quantized weights (rust-facts §8). Raises ImportError without llama-cpp-python and
    ValueError when llama.cpp cannot load the file.
    """

    name = "llama.cpp"

    def __init__(self, path: str | Path, threads: int | None = None, n_ctx: int | None = None,
                 logits_all: bool = False, f32_cache: bool = True, extra_bufts: bool = False):
        import llama_cpp  # deferred: the optional bench extra (a source build); only benchmarks and tests use it
        import llama_cpp.llama_cpp as C

        default_params = C.llama_model_default_params

        def params():
            p = default_params()
            p.use_extra_bufts = extra_bufts
            return p

        C.llama_model_default_params = params  # Llama() reads its model params from this function
        try:
            ctx = min(n_ctx, gguf_context_length(path)) if n_ctx else gguf_context_length(path)
            f32 = int(C.GGML_TYPE_F32)
            self.llm = llama_cpp.Llama(model_path=str(path), n_ctx=ctx, n_batch=ctx, n_ubatch=ctx, n_threads=threads,
                                       n_threads_batch=threads, logits_all=logits_all,
                                       type_k=f32 if f32_cache else None, type_v=f32 if f32_cache else None,
                                       verbose=False)
        finally:
            C.llama_model_default_params = default_params
        self.logits_all = logits_all
        self.vocab_size = int(self.llm.n_vocab())
        self.max_position_embeddings = ctx
        self.threads = threads

    def new_sequence(self) -> LlamaCppSequence:
        """Reset the context and return it as a Sequence at position 0."""
        return LlamaCppSequence(self)

    def close(self) -> None:
        """Free llama.cpp's model and context now."""
        self.llm.close()


def gguf_context_length(path: str | Path) -> int:
    """``<arch>.context_length`` of a GGUF file (memory-mapped read; tensors are not loaded). KeyError if absent."""
    from gguf import GGUFReader  # deferred: the gguf package (export extra) only for this header read

    r = GGUFReader(str(path))
    arch = r.fields["general.architecture"].contents()
    return int(r.fields[f"{arch}.context_length"].contents())
