"""Shalik serving: load a bundle and generate, stream, complete, chat or score on CPU — without torch.

    from serve import load
    lm = load("runs/cpu/bundle", backend="onnx")          # or backend="rust", quantize="q8_0"
    print(lm.generate("আমি বাংলায়", max_new_tokens=32, temperature=0.8, seed=1))
    print(lm.chat([{"role": "user", "content": "নদীর নাম বলো।"}], 64).text)   # a fine-tuned chat model

HTTP: ``uvicorn serve.app:app`` (serve/http/). Command line: ``python -m serve.generate BUNDLE``. The bundle
contract — file names, manifest, ONNX I/O names, special tokens — is :mod:`contract.bundle`.
"""

from serve.errors import ContextLengthError, ModelOutputError, RequestError
from serve.generation import Generation
from serve.lm import LM
from serve.loader import load
from serve.results import Completion, Score, TokenLogprobs
from serve.sampling import SamplingParams

__all__ = ["LM", "Completion", "ContextLengthError", "Generation", "ModelOutputError", "RequestError",
           "SamplingParams", "Score", "TokenLogprobs", "load"]
