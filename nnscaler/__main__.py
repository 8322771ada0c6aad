"""``python -m nnscaler <command>`` (``--version`` prints the version)."""

from __future__ import annotations

import argparse
import sys


def main(argv: list[str] | None = None) -> int:
    from nnscaler import __version__

    parser = argparse.ArgumentParser(prog="python -m nnscaler")
    parser.add_argument("--version", action="version", version=f"nnscaler {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser(
        "plugins",
        help="list every plugin, its distribution and version, and what it registered",
    )
    from nnscaler.parallel import verification

    verification.add_arguments(sub.add_parser(
        "verify",
        help="run a plan and the single-device model op by op; report the first op that "
             "differs (docs/verify.md)",
    ))
    args = parser.parse_args(argv)
    if args.command == "plugins":
        from nnscaler.plugins import get_plugin_manager

        print(get_plugin_manager().report())
    elif args.command == "verify":
        return verification.run_command(args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
