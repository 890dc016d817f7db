"""``python -m trainkit.checkpoint consolidate SRC DST``: a sharded checkpoint (a directory that
``strategy=fsdp strategy.checkpoint=sharded`` writes) as one file that ``torch.load(DST,
weights_only=True)``, eval.py and every strategy read. The whole model is assembled in this
process: run it where its weights and optimizer state fit in memory."""

import argparse
import sys
from pathlib import Path

from trainkit.checkpoint_io import atomic_torch_save, consolidated, is_sharded


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m trainkit.checkpoint")
    commands = parser.add_subparsers(dest="command", required=True)
    consolidate = commands.add_parser("consolidate", help="a sharded checkpoint as one file")
    consolidate.add_argument("src", type=Path, help="the sharded checkpoint (a directory)")
    consolidate.add_argument("dst", type=Path, help="the one file to write")
    args = parser.parse_args(argv)
    if not is_sharded(args.src):
        print(f"{args.src} is not a sharded checkpoint (a directory with .metadata and meta.pt)",
              file=sys.stderr)  # fmt: skip
        return 2
    atomic_torch_save(consolidated(args.src), args.dst)
    print(f"{args.dst}: one file of {args.src}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
