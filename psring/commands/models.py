"""What psring knows: ``psring models`` (sizes, FLOPs, arithmetic intensity) and
``psring strategies`` (the registered strategies, plugins included).

    psring models [--classes 1000 --image-size 224]
    psring strategies
"""

from __future__ import annotations

import argparse
import sys

from rich.console import Console
from rich.table import Table

from psring.errors import ConfigError
from psring.strategies import STRATEGIES
from psring.train.models import MODELS, ModelSettings, describe


def models(args: argparse.Namespace) -> int:
    """A table of the models asked for (default every built-in one) at these sizes."""
    s = ModelSettings(classes=args.classes, image_size=args.image_size, seq_len=args.seq_len,
                      features=args.features, width=args.width, depth=args.depth)
    names = args.model or list(MODELS)
    table = Table(title=f"psring models: {args.classes} classes, {args.image_size}x"
                  f"{args.image_size} images, {args.seq_len}-token sequences, "
                  f"{args.features} features; intensity at batch {args.batch_size}")
    for col in ("model", "input", "parameters", "gradient MB", "GFLOPs/sample",
                "FLOPs/byte"):
        table.add_column(col, justify="left" if col in ("model", "input") else "right")
    skipped = []
    for name in names:
        try:
            d = describe(name, s, args.batch_size)
        except ConfigError as e:
            if args.model:  # asked for by name: its error is the answer
                raise
            skipped.append(f"{name}: {e}")  # (inception_v3 at 32 x 32 images)
            continue
        i = d["inputs"]
        table.add_row(name, f"{i.kind} {'x'.join(map(str, i.shape))}", f"{d['parameters']:,}",
                      f"{d['gradient_bytes'] / 1e6:.2f}",
                      f"{d['flops_per_sample'] / 1e9:.4g}", f"{d['intensity']:.3g}")
    Console(width=130).print(table)
    for line in skipped:
        print(f"not at these sizes: {line}")
    print("FLOPs: forward+backward per sample (torch.utils.flop_counter: matmuls, "
          "convolutions, attention). FLOPs/byte: a batch's FLOPs per byte of float32 "
          "gradients, the arithmetic intensity a strategy's communication is set against.")
    return 0


def strategies(args: argparse.Namespace) -> int:
    """Each registered strategy with its module's first line."""
    for name in STRATEGIES:
        cls = STRATEGIES.get(name)
        doc = (cls.__module__ and sys.modules[cls.__module__].__doc__ or "").strip()
        print(f"{name:<10} {doc.splitlines()[0] if doc else ''}")
    return 0
