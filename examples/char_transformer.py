"""train.py's model and data in a short loop of your own: lioncub.recipe's pieces with Lion Cub.

A character transformer learns the Python standard library's sources; every rank draws its
own batches, DistributedLion exchanges quantized votes, and the validation loss (split over
the ranks) falls from ln(97) = 4.57 nats per character.

    python -m launch -n 2 examples/char_transformer.py
    mpiexec -n 2 python examples/char_transformer.py
"""

from __future__ import annotations

import torch

import bitcoll
from lioncub.recipe.data import VOCAB_SIZE, BatchSampler, load_corpus
from lioncub.recipe.loop import evaluate, lr_at
from lioncub.recipe.models import CharTransformer, token_loss
from lioncub.torch import DistributedLion

STEPS, LR, BATCH, SEQ = 40, 3e-3, 8, 64


def main() -> None:
    torch.set_num_threads(1)
    with bitcoll.init() as comm:
        corpus = load_corpus(0.3)                        # the same 0.3 MB on every rank
        torch.manual_seed(0)                             # the same starting weights
        model = CharTransformer(VOCAB_SIZE, d_model=64, layers=1, heads=2, seq_len=SEQ)
        opt = DistributedLion(model.named_parameters(), comm, variant="lioncub-l1", lr=LR)
        sampler = BatchSampler(corpus.train, BATCH, SEQ, seed=0, rank=comm.rank)
        before = evaluate(model, comm, corpus.val, BATCH, SEQ, eval_batches=2)
        for step in range(1, STEPS + 1):
            for group in opt.param_groups:
                group["lr"] = lr_at(step, STEPS, LR, warmup=4, schedule="cosine")
            x, y = sampler.next()                        # this rank's own windows
            loss = token_loss(model, x, y)
            opt.zero_grad()
            torch.autograd.backward(loss)
            opt.step()                                   # votes -> one update on every rank
        after = evaluate(model, comm, corpus.val, BATCH, SEQ, eval_batches=2)
        opt.check_replicas()                             # ReplicaMismatchError if they differ
        if comm.rank == 0:
            print(f"{comm.size} ranks: validation loss {before:.3f} -> {after:.3f} nats per "
                  "character", flush=True)


if __name__ == "__main__":
    main()
