"""Flower's SuperNode with shorter waits: ``python -m fedfm.runtime.flower.supernode ARGS``.

The arguments, the loop and the log lines are those of Flower's ``flower-supernode``; only
its polls and object-pull retries are shortened (:mod:`fedfm.runtime.flower.pacing`).
"""

from fedfm.runtime.flower.pacing import main

if __name__ == "__main__":
    main()
