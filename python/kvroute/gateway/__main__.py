"""`python -m kvroute.gateway ...`: the same as `kvroute serve ...`."""

from __future__ import annotations

import argparse
import sys

from .config import add_arguments
from .server import main

if __name__ == "__main__":
    parser = argparse.ArgumentParser(prog="python -m kvroute.gateway")
    add_arguments(parser)
    try:
        sys.exit(main(parser.parse_args()))
    except (ValueError, TypeError, KeyError) as exc:
        print(f"kvroute serve: error: {exc}", file=sys.stderr)
        sys.exit(2)
