"""The chunked loss op's time against the number of rows a chunk has (``ChunkLoss.min_rows``).

The loss and its gradients (forward and backward) of one ``tokens x hidden`` head over a vocabulary,
chunked at several row counts, with the gradients in forward and recomputed, each over eager's
whole ``F.cross_entropy(F.linear(h, w), t)`` (best of ``--repeats`` after a warm-up, one thread):

    python -m benchmarks.chunked_loss_rows                      # Gemma's 256000 vocabulary, hidden 512

A chunk of few rows runs the head's matmuls, and the weight gradient's accumulation (the whole
``vocab x hidden`` gradient read and written once per chunk), far under their rate.
"""

from __future__ import annotations

import argparse
import logging
import time
from typing import Callable

import torch
import torch.nn.functional as F

from remat_pass.capture.chunked_loss_op import chunked_linear_cross_entropy, chunked_linear_cross_entropy_with_gradients

log = logging.getLogger(__name__)


def best_seconds(step: Callable[[], None], tensors: tuple[torch.Tensor, ...], repeats: int) -> float:
    """The fastest of ``repeats`` runs of ``step`` after one warm-up, gradients cleared between."""
    def clear() -> None:
        for tensor in tensors:
            tensor.grad = None

    step()
    clear()
    best = float("inf")
    for _ in range(repeats):
        started = time.perf_counter()
        step()
        best = min(best, time.perf_counter() - started)
        clear()
    return best


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=1024)
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--vocab", type=int, default=256000)
    parser.add_argument("--rows", type=int, nargs="+", default=[16, 64, 256, 1024])
    parser.add_argument("--repeats", type=int, default=2)
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    torch.set_num_threads(1)
    torch.manual_seed(0)
    h = torch.randn(args.tokens, args.hidden, requires_grad=True)
    w = (torch.randn(args.vocab, args.hidden) * 0.02).requires_grad_()
    t = torch.randint(0, args.vocab, (args.tokens,))
    settings = (None, t, None, "", -100, 0.0, "mean")

    def eager() -> None:
        F.cross_entropy(F.linear(h, w), t).backward()

    whole = best_seconds(eager, (h, w), args.repeats)
    log.info("eager, the loss whole: %.2f s", whole)
    log.info("| rows a chunk | gradients in forward / eager | recomputed / eager |")
    log.info("|---|---|---|")
    for rows in args.rows:
        def in_forward() -> None:
            chunked_linear_cross_entropy_with_gradients(h, w, *settings, rows, True, True)[0].backward()

        def recomputed() -> None:
            chunked_linear_cross_entropy(h, w, *settings, rows).backward()

        log.info("| %d | %.2f | %.2f |", rows, best_seconds(in_forward, (h, w), args.repeats) / whole,
                 best_seconds(recomputed, (h, w), args.repeats) / whole)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
