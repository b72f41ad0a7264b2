"""The model of ``train.py``: a GPT-style character transformer, its size presets and dtypes.

* :class:`CharTransformer` (of :class:`Block`), built by :data:`PRESETS` (``--model``) or by
  hand; :func:`token_loss` is its mean token cross-entropy in nats.
* :data:`DTYPES` and :func:`autocast`: the compute dtypes (``--dtype``).
* :class:`HostParams`: float32 host copies of a device model's parameters, for an optimizer
  that works on host memory.
"""

from __future__ import annotations

import contextlib
import inspect
import math
from contextlib import AbstractContextManager
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from lioncub.torch import DistributedLion

__all__ = ["Block", "CharTransformer", "ModelShape", "PRESETS", "DTYPES",
           "OPTIMIZER_TAKES_DEVICE_PARAMS", "autocast", "token_loss", "HostParams"]

class Block(nn.Module):
    """Pre-norm transformer block: causal multi-head self-attention, then a 4x GELU MLP."""

    def __init__(self, d_model: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.ln1 = nn.LayerNorm(d_model)
        self.qkv = nn.Linear(d_model, 3 * d_model)
        self.proj = nn.Linear(d_model, d_model)
        self.ln2 = nn.LayerNorm(d_model)
        self.fc = nn.Linear(d_model, 4 * d_model)
        self.out = nn.Linear(4 * d_model, d_model)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        qkv = self.qkv(self.ln1(x)).view(b, t, 3, self.heads, d // self.heads)
        q, k, v = qkv.permute(2, 0, 3, 1, 4)
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(a.transpose(1, 2).reshape(b, t, d))
        y: torch.Tensor = x + self.out(F.gelu(self.fc(self.ln2(x))))
        return y


class CharTransformer(nn.Module):
    """A GPT-style character model: token + learned position embeddings, ``layers`` blocks,
    final LayerNorm and a linear head.

    ``forward(x)`` takes int64 tokens of shape ``(batch, t)`` with ``t <= seq_len`` and returns
    float32 logits of shape ``(batch, t, vocab_size)``. Weights are drawn from the global torch
    generator (seed it identically on every rank for identical replicas): normal(0, 0.02),
    residual projections scaled by ``1/sqrt(2 * layers)``, biases zero.
    """

    def __init__(self, vocab_size: int, d_model: int, layers: int, heads: int,
                 seq_len: int) -> None:
        super().__init__()
        if d_model % heads:
            raise ValueError(f"d_model {d_model} is not a multiple of heads {heads}")
        self.seq_len = seq_len
        self.tok = nn.Embedding(vocab_size, d_model)
        self.pos = nn.Embedding(seq_len, d_model)
        self.blocks = nn.ModuleList(Block(d_model, heads) for _ in range(layers))
        self.ln = nn.LayerNorm(d_model)
        self.head = nn.Linear(d_model, vocab_size, bias=False)
        for name, p in self.named_parameters():
            if name.endswith("bias"):
                nn.init.zeros_(p)
            elif p.dim() >= 2:
                std = 0.02 / math.sqrt(2 * layers) if name.endswith(("proj.weight",
                                                                       "out.weight")) else 0.02
                nn.init.normal_(p, 0.0, std)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.tok(x) + self.pos(torch.arange(x.shape[1], device=x.device))
        for block in self.blocks:
            h = block(h)
        logits: torch.Tensor = self.head(self.ln(h))
        return logits


@dataclass(frozen=True)
class ModelShape:
    """A ``--model`` preset: width, depth and heads (``approx_params`` at ``--seq-len 128``)."""

    d_model: int
    layers: int
    heads: int
    approx_params: str


PRESETS: dict[str, ModelShape] = {
    "tiny": ModelShape(128, 2, 4, "0.44M"),
    "small": ModelShape(384, 6, 6, "10.8M"),
    "medium": ModelShape(512, 10, 8, "31.7M"),
}
"""``--model`` presets; ``--d-model``, ``--layers`` and ``--heads`` override their values."""

DTYPES: dict[str, torch.dtype] = {"fp32": torch.float32, "bf16": torch.bfloat16,
                                  "fp16": torch.float16}
"""``--dtype`` values: the dtype of the forward and backward computation."""


#: Whether lioncub's DistributedLion takes parameters of any device and of 16-bit dtypes (its
#: torch engine); otherwise it takes float32 CPU tensors only and train.py keeps float32
#: parameters (autocast for 16-bit compute, a host copy for --device cuda).
OPTIMIZER_TAKES_DEVICE_PARAMS: bool = "backend" in inspect.signature(
    DistributedLion.__init__).parameters


def autocast(device: str, dtype: torch.dtype) -> AbstractContextManager[Any]:
    """``torch.autocast(device, dtype)`` for a 16-bit ``dtype``, a no-op for float32."""
    if dtype == torch.float32:
        return contextlib.nullcontext()
    return torch.autocast(device, dtype=dtype)


def token_loss(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """Mean cross-entropy (nats per token, float32) of ``model``'s logits for inputs ``x``
    against targets ``y`` (int64, shape ``(batch, t)``)."""
    logits = model(x)
    return F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), y.reshape(-1))


class HostParams:
    """Float32 CPU copies of a model's parameters, for an optimizer that works on host memory
    while the model runs on another device.

    ``named()`` gives ``(name, host tensor)`` pairs to build the optimizer on;
    :meth:`pull_grads` copies the device gradients into the host tensors' ``grad`` (None stays
    None), :meth:`push_params` the updated host values back onto the device, and
    :meth:`pull_params` the device values to the host (after loading a checkpoint into the
    model)."""

    def __init__(self, model: nn.Module) -> None:
        named = list(model.named_parameters())
        self._names = [n for n, _ in named]
        self._device = [p for _, p in named]
        self._host = [p.detach().to("cpu", torch.float32).clone().requires_grad_(p.requires_grad)
                      for p in self._device]

    def named(self) -> list[tuple[str, torch.Tensor]]:
        return list(zip(self._names, self._host, strict=True))

    @torch.no_grad()
    def pull_grads(self) -> None:
        for d, h in zip(self._device, self._host, strict=True):
            if d.grad is None:
                h.grad = None
            elif h.grad is None:
                h.grad = d.grad.to("cpu", torch.float32)
            else:
                h.grad.copy_(d.grad)

    @torch.no_grad()
    def push_params(self) -> None:
        for d, h in zip(self._device, self._host, strict=True):
            d.copy_(h, non_blocking=True)

    @torch.no_grad()
    def pull_params(self) -> None:
        for d, h in zip(self._device, self._host, strict=True):
            h.copy_(d)

