"""Shalik serving: load a bundle and generate, stream, complete or score on CPU — without torch.

    from serve import load
    lm = load("runs/small/bundle", backend="onnx")          # or backend="rust", quantize="int8"
    print(lm.generate("আমি বাংলায়", max_new_tokens=32, temperature=0.8, seed=1))

HTTP: ``uvicorn serve.app:app`` (see serve/app.py). Command line: ``python -m serve.generate BUNDLE``.
"""

from serve.errors import ContextLengthError, ModelOutputError, RequestError
from serve.lm import LM, Completion, Generation, Score, TokenLogprobs, load
from serve.sampling import SamplingParams

__all__ = ["LM", "Completion", "ContextLengthError", "Generation", "ModelOutputError", "RequestError",
           "SamplingParams", "Score", "TokenLogprobs", "load"]
