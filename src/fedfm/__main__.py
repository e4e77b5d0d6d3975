"""``python -m fedfm``: the same command line as the ``fedfm`` script."""

from fedfm.cli import main

if __name__ == "__main__":
    main()
