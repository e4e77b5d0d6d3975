"""``python -m fedfm.runtime.flower_app``: the Flower commands of fedfm on their own.

The same commands as ``fedfm serve``, ``fedfm client``, ``fedfm flower-app`` and
``fedfm flower-certs``, for machines or scripts that call them without the ``fedfm`` CLI.
"""

from __future__ import annotations

import logging
import sys

import typer

from fedfm.errors import ConfigError, FedfmError
from fedfm.runtime.flower_app.deploy import add_commands

app = typer.Typer(add_completion=False, no_args_is_help=True, help=__doc__)
add_commands(app)


def main() -> None:
    """Runs a command; fedfm errors print one line and exit 2 (bad input) or 1."""
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(message)s")
    try:
        app(standalone_mode=False)
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)
    except FedfmError as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(1)


if __name__ == "__main__":
    main()
