"""The pieces of ``train.py``, importable: a recipe for data-parallel training with lioncub.

``train.py`` is a short program built from these modules; examples and benchmarks reuse them.
The modules import torch, except :mod:`~lioncub.recipe.logs` (numpy only, for log readers such
as ``bench/plot_curves.py``); the numpy-only parts of lioncub never import this package.

* :mod:`lioncub.recipe.data`: the corpus (the Python standard library's sources as byte
  tokens), :class:`~lioncub.recipe.data.BatchSampler` and the windows it draws.
* :mod:`lioncub.recipe.models`: the character transformer, its size presets, the compute
  dtypes, autocast, the token loss and the host copy of device parameters.
* :mod:`lioncub.recipe.loop`: the learning-rate schedule, fp16 loss scaling, evaluation,
  the per-step figures and the replica checks.
* :mod:`lioncub.recipe.logs`: rank 0's progress display, the JSON log and the final summary.
* :mod:`lioncub.recipe.checkpoints`: per-rank checkpoints, checked on resume.
* :mod:`lioncub.recipe.ddp`: torch's DistributedDataParallel mode (process group and the
  optimizer front end of the hooks).
* :mod:`lioncub.recipe.fault_tolerant`: the training loop of an elastic job
  (:class:`lioncub.elastic.ElasticLion` over :class:`bitcoll.elastic.ElasticGroup`).
* :mod:`lioncub.recipe.options`: ``train.py``'s command line.

The modules are imported one by one (``from lioncub.recipe.data import load_corpus``): this
package imports none of them.
"""
