"""The parts a training run is wired from (torchtitan's ``components``); ``train.run.Trainer`` is the loop that
wires them. Each owns its mechanism (one module each):

* :mod:`~train.components.placement` — where the steps run: device, ranks and torchrun's process group and
  collectives, dtype, the per-rank micro-batch split, CUDA fast paths, the memory plan check, the SDPA backend,
  autocast;
* :mod:`~train.components.run_data` — the run's data: prepare (rank 0, the others waiting under torchrun), the
  tokenizer, the training loader, the validation windows, characters per token;
* :mod:`~train.components.state` — the counters carried from step to step and across a resume;
* :mod:`~train.components.checkpoint` — the checkpoint file formats, and ``runs/NAME/checkpoints``: save,
  resume, ``--init-from``, refusing an existing run, the model-config comparison, ``trainer_state.json``;
* :mod:`~train.components.run_log` — the rest of ``runs/NAME``: config.toml, train.log, metrics.jsonl (and its
  truncation on resume), samples.jsonl, preflight.json, loss.png, summary.json; the throughput meter;
* :mod:`~train.components.evaluation` — validation NLL and bits per character, samples; the periodic evaluation,
  the random-init twin, the final report;
* :mod:`~train.components.step_module` — the module a step calls: compiled or eager (with the fallback), DDP;
* :mod:`~train.components.signals` — SIGTERM / SIGINT as a stop request.
"""
