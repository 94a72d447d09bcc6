"""The `kvroute` command line."""

from __future__ import annotations

import argparse
import sys

import numpy as np

import kvroute


def _cmd_hash(args: argparse.Namespace) -> int:
    tokens = np.array([int(t) for t in args.tokens.replace(",", " ").split()], dtype=np.int64)
    hashes = kvroute.block_hashes(tokens, args.block_size, salt=args.salt)
    print(f"{len(tokens)} tokens, block size {args.block_size}, {len(hashes)} full blocks "
          f"({kvroute.implementation} implementation)")
    for i, h in enumerate(hashes):
        print(f"block {i:4d}  {int(h):#018x}")
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="kvroute", description=kvroute.__doc__.splitlines()[0])
    parser.add_argument("--version", action="version", version=f"kvroute {kvroute.__version__}")
    sub = parser.add_subparsers(dest="command", required=True)
    p_hash = sub.add_parser("hash", help="print the chained block hashes of a token list")
    p_hash.add_argument("tokens", nargs="?", default=" ".join(str(t) for t in range(100)),
                        help="token ids separated by spaces or commas (default 0..99)")
    p_hash.add_argument("--block-size", type=int, default=16)
    p_hash.add_argument("--salt", default=None)
    p_hash.set_defaults(func=_cmd_hash)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return int(args.func(args))
    except (ValueError, TypeError, KeyError, IndexError) as exc:
        print(f"kvroute: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
