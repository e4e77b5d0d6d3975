"""``python -m fedfm.runtime.flower_app ...`` is the ``fedfm`` command (serve, client, ...)."""

from fedfm.cli import main

if __name__ == "__main__":
    main()
