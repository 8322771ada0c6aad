"""``python -m nnscaler <command>``."""

from __future__ import annotations

import argparse
import sys


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m nnscaler")
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser(
        "plugins",
        help="list every plugin, its distribution and version, and what it registered",
    )
    args = parser.parse_args(argv)
    if args.command == "plugins":
        from nnscaler.plugins import get_plugin_manager

        print(get_plugin_manager().report())
    return 0


if __name__ == "__main__":
    sys.exit(main())
