"""lioncub: the Lion optimizer and its communication-efficient distributed variants.

* :func:`lion_update`: Lion's update rule (Chen et al., arXiv 2302.06675) on numpy arrays.
* :func:`quantize`: Lion Cub's vote quantizers ("sign", "l1", "l0", "linf").
* :class:`DistributedLion`: data-parallel Lion over a bitcoll communicator, in one of
  :data:`VARIANTS`: Global Lion (float32 gradient all-reduce), Distributed Lion (arXiv
  2404.00438; majority vote or averaging over an all-gather of sign bits) and Lion Cub (arXiv
  2411.16462; 1-bit majority or exact p-bit sums of quantized votes through bandwidth-optimal
  all-reduces), with optional momentum synchronization schedules (:mod:`lioncub.sync`).
  Construction broadcasts rank 0's parameters (or, with ``broadcast_parameters=False``,
  checks that the ranks' parameters agree); ``check_replicas()`` checks at any time
  (:mod:`lioncub.replicas`).
* :data:`SPECS`: the variant registry (:mod:`lioncub.variants`); each variant is one strategy
  object (:mod:`lioncub.strategies`) that the optimizer calls instead of branching on the
  variant. A new variant is one strategy class and one :func:`lioncub.variants.register` line.
* :class:`CommLike`: the communicator interface lioncub uses (:mod:`lioncub.comm`).
* :mod:`lioncub.torch`: ``torch.optim`` front ends (``Lion``, ``DistributedLion``) and the DDP
  hook ``no_allreduce_hook``. ``DistributedLion`` runs on the numpy core (float32 CPU
  tensors, shared memory) or on :mod:`lioncub.torch_engine` (any device, float32 / bfloat16 /
  float16, packing done on the device by :mod:`lioncub.torch_layout`), and can overlap its
  communication with the backward pass (``overlap=True``; the core's
  :meth:`DistributedLion.ready`). These modules import torch and are not imported here.

Example (run with ``python -m launch -n 4 script.py`` or ``mpiexec -n 4 python script.py``)::

    import numpy as np, bitcoll, lioncub
    with bitcoll.init() as comm:
        w = np.zeros(1000, np.float32)                     # rank 0's copied to all ranks
        opt = lioncub.DistributedLion([w], comm, variant="lioncub-l1", lr=1e-3)
        for step in range(100):
            g = compute_gradient(w)                        # this rank's minibatch
            opt.step([g])                                  # w stays identical on all ranks
        opt.check_replicas()                               # UsageError if the ranks differ

Errors are :class:`bitcoll.errors.UsageError` (bad arguments) and bitcoll's ``CommError``
family (communication).
"""

from bitcoll.errors import UsageError

from .buckets import Bucket, Slot, make_buckets
from .comm import CommLike
from .distributed import DEFAULT_BUCKET_BYTES, TIE_RULES, DistributedLion
from .lion import Hyper, lion_update
from .quantize import METHODS, default_levels, quantize
from .replicas import ReplicaMismatchError, ReplicaSet
from .stats import StepStats
from .sync import (
    Adaptive,
    EarlyPhase,
    EveryK,
    Exponential,
    MomentumSync,
    NoSync,
    Selective,
    parse_sync,
)
from .variants import SPECS, VARIANTS, VariantSpec

__version__ = "0.1.0"

__all__ = [
    "lion_update",
    "Hyper",
    "quantize",
    "METHODS",
    "default_levels",
    "VARIANTS",
    "SPECS",
    "VariantSpec",
    "DistributedLion",
    "DEFAULT_BUCKET_BYTES",
    "TIE_RULES",
    "StepStats",
    "MomentumSync",
    "NoSync",
    "EveryK",
    "Exponential",
    "EarlyPhase",
    "Adaptive",
    "Selective",
    "parse_sync",
    "Bucket",
    "Slot",
    "make_buckets",
    "CommLike",
    "ReplicaSet",
    "ReplicaMismatchError",
    "UsageError",
]
