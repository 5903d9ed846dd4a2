"""Supervised fine-tuning: a pretrained run → a chat model (``python -m train.sft RUN``).

``cli`` (the command line and the config over the pretrained run's), ``trainer`` (the :class:`train.run.Trainer`
configuration: data, starting weights, evaluation), ``data`` (conversations as padded, loss-masked windows),
``formats`` (messages / Alpaca / ShareGPT rows), ``encode`` (ids and loss mask from the tokenizer's offsets; the
chat tokens a tokenizer lacks), ``init`` (the pretrained weights, grown by the chat tokens), ``build`` (the
Bangla + English set built from the project's corpus: ``python -m train.sft.build``).
"""
