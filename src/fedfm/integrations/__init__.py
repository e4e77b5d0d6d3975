"""Ways into fedfm for code written for other libraries.

* :mod:`fedfm.integrations.hf` — a Hugging Face ``Trainer`` script as the local step of the
  FedAvg family (task kind ``hf_trainer``).

Importing the package registers those task kinds; the ``fedfm`` command imports it, and a
Flower run names it in ``flower.imports`` so that every process registers them.
"""

from fedfm.integrations import hf  # noqa: F401  (registers the hf_trainer task)
