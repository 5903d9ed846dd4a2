"""Type stubs for the rust_runtime extension (see README.md)."""

from collections.abc import Iterator
from collections.abc import Sequence as Seq
from os import PathLike
from typing import TypedDict

import numpy as np
import numpy.typing as npt
from typing_extensions import Unpack

__version__: str
simd_level: str  # "Avx512", "Avx2Fma" or "Generic": the f32 kernels picked at run time
int_simd_level: str  # "Avx512Vnni", "Avx2" or "Generic": the integer kernels (quantized weights)
QUANTIZE_NAMES: tuple[str, ...]  # ("none", "int8", "q4_0", "q4_mix"): what Model.load(quantize=...) accepts (contract.quant's names)
QUANTIZE_PLAN: dict[str, dict[str, str | None]]  # name -> role (q_proj, ..., lm_head) -> "q8_0" / "q4_0" / None (f32)
MAX_THREADS: int  # 1024: Model.load's threads at most (serve.loader.MAX_THREADS)
GREEDY_TEMPERATURE: float  # 1e-5: temperatures below it are greedy (serve.sampling.GREEDY_TEMPERATURE)
REPETITION_PENALTY_RANGE: tuple[float, float]  # (0.1, 10.0), both ends allowed (serve.sampling's)
PENALTY_RANGE: tuple[float, float]  # (-2.0, 2.0): presence_penalty and frequency_penalty (serve.sampling's)

class SamplingKwargs(TypedDict, total=False):
    """The sampling keyword arguments of Model.generate, Model.stream, Engine.submit and Sampler, parsed in one
    place (python.rs SamplingArgs) with serve.sampling.SamplingParams's names and rules. Absent or None = the
    default; a bad value is a ValueError naming it; any other keyword a TypeError naming it."""

    temperature: float | None  # >= 0, default 1.0; below 1e-5 greedy (ties to the lower id)
    top_k: int | None  # >= 0, default 0 (off); any k >= the vocabulary is off too
    top_p: float | None  # in [0, 1], default 1.0 (off); 0 keeps the top token
    presence_penalty: float | None  # in PENALTY_RANGE ([-2, 2]), default 0.0
    frequency_penalty: float | None  # in PENALTY_RANGE ([-2, 2]), default 0.0
    repetition_penalty: float | None  # in REPETITION_PENALTY_RANGE ([0.1, 10]), default 1.0 (off)
    seed: int | None  # any int, taken modulo 2**64; None (default) = fresh entropy

class Model:
    @staticmethod
    def load(
        path: str | PathLike[str], threads: int | None = None, quantize: str | None = None, verify: bool = True,
        allow_ungated: bool = False,
    ) -> Model: ...
    @property
    def vocab_size(self) -> int: ...
    @property
    def max_position_embeddings(self) -> int: ...
    @property
    def num_hidden_layers(self) -> int: ...
    @property
    def hidden_size(self) -> int: ...
    @property
    def num_attention_heads(self) -> int: ...
    @property
    def num_key_value_heads(self) -> int: ...
    @property
    def rope_theta(self) -> float: ...
    @property
    def quantize(self) -> str: ...  # a name of QUANTIZE_NAMES
    @property
    def eot_id(self) -> int | None: ...
    @property
    def threads(self) -> int: ...
    @property
    def path(self) -> str: ...
    def logits(self, ids: Seq[int]) -> npt.NDArray[np.float32]: ...
    def new_sequence(self) -> Sequence: ...
    def tokenize(self, text: str) -> list[int]: ...
    def decode(self, ids: Seq[int], skip_special_tokens: bool = False) -> str: ...
    def generate(
        self, ids: Seq[int], max_new_tokens: int, *, stop_ids: Seq[int] | None = None,
        **sampling: Unpack[SamplingKwargs],
    ) -> list[tuple[int, float]]: ...
    def stream(
        self, ids: Seq[int], max_new_tokens: int, *, stop_ids: Seq[int] | None = None,
        **sampling: Unpack[SamplingKwargs],
    ) -> TokenStream: ...

class Sequence:
    @property
    def position(self) -> int: ...
    def prefill(self, ids: Seq[int], all_logits: bool = False) -> npt.NDArray[np.float32]: ...
    def decode(self, token_id: int) -> npt.NDArray[np.float32]: ...
    def reset(self) -> None: ...

class TokenStream(Iterator[tuple[int, float]]):
    def __iter__(self) -> TokenStream: ...
    def __next__(self) -> tuple[int, float]: ...

class Tokenizer:
    def __init__(self, path: str | PathLike[str]) -> None: ...
    @property
    def vocab_size(self) -> int: ...
    def encode(self, text: str) -> list[int]: ...
    def decode(self, ids: Seq[int], skip_special_tokens: bool = False) -> str: ...
    def token_to_id(self, token: str) -> int | None: ...

# (choice index, token id or None, logprob (NaN at the end), top logprobs [(id, logprob)], finish reason or None);
# a "stop" at end-of-text / a stop id carries that token (not output) with its logprob and top logprobs
Event = tuple[int, int | None, float, list[tuple[int, float]], str | None]

class RequestStream(Iterator[Event]):
    """cancel(), cancel_choice() and id work from any thread while another thread blocks in next()."""
    @property
    def id(self) -> int: ...
    def __iter__(self) -> RequestStream: ...
    def __next__(self) -> Event: ...
    def cancel(self) -> None: ...
    def cancel_choice(self, index: int) -> None: ...

class Engine:
    def __init__(self, model: Model, max_batch: int | None = None, token_budget: int | None = None,
                 prefill_chunk: int | None = None) -> None:
        """max_batch: sequences stepped together; token_budget: tokens per step (decodes plus prompt chunks);
        prefill_chunk: at most this many prompt tokens in a step that also decodes (a step with nothing
        decoding prefills up to token_budget). None: the default. Defaults and limits: src/policy.rs, equal to
        serve.policy's (a test checks); TypeError naming a bool or non-integer, ValueError naming one out of
        range."""
    @property
    def max_batch(self) -> int: ...
    @property
    def token_budget(self) -> int: ...
    @property
    def prefill_chunk(self) -> int: ...
    def submit(
        self,
        ids: Seq[int],
        max_new_tokens: int,
        *,
        stop_ids: Seq[int] | None = None,
        n: int | None = None,
        top_logprobs: int | None = None,
        timeout: float | None = None,
        ignore_eos: bool = False,
        first_index: int | None = None,
        **sampling: Unpack[SamplingKwargs],
    ) -> RequestStream:
        """n <= max_batch choices (one prefill; None: 1); top_logprobs 0 to 1000 (None: 0); timeout: seconds from now, then the choices still running end
        "timeout"; first_index: the caller's index of this request's choice 0 (None: 0); choice i draws from
        choice_seed(seed, first_index + i) (choice_seed(s, 0) = s). TypeError naming an integer argument given a
        bool or another type, ValueError naming one out of range (also past 64 bits)."""
    def cancel(self, id: int) -> None: ...
    def stats(self) -> dict[str, int | float]: ...
    def close(self) -> None: ...

class Sampler:
    """The engine's per-sequence sampler on its own (rust_runtime/src/sampling.rs, the code every Engine and
    Model.generate sequence runs): ``Sampler(...)(logits) -> token id``. Keeps its own penalty state (prompt
    ids; generated-token counts, each call's pick recorded) and seeded generator; the vocab is the first
    call's logits length. The sampling keywords of Engine.submit (SamplingKwargs). Same order and edges as
    serve.sampling."""

    def __init__(self, *, prompt_ids: Seq[int] | None = None, **sampling: Unpack[SamplingKwargs]) -> None: ...
    def __call__(self, logits: npt.ArrayLike) -> int: ...  # float [vocab] → id; RuntimeError for NaN/+inf/all -inf
    def penalize(self, logits: npt.ArrayLike) -> npt.NDArray[np.float32]: ...  # after the penalties; records nothing
    @property
    def generated(self) -> list[int]: ...
    @property
    def prompt_ids(self) -> list[int]: ...

def log_softmax(logits: npt.ArrayLike) -> npt.NDArray[np.float32]: ...  # [vocab], as the engine's logprobs
def top_logprobs(logits: npt.ArrayLike, n: int) -> list[tuple[int, float]]: ...  # of raw logits; ties: lower id
