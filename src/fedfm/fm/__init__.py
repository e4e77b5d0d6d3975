"""Foundation models through one handle (DESIGN.md principle 11).

A task that has a causal LM hands out a :class:`FoundationModel` from
:meth:`fedfm.tasks.base.Task.foundation_model`; algorithms call only its methods, never task
internals. What it offers:

* **Adapters as named, live objects.** The frozen base is loaded once per process and wrapped
  once by peft; every handle on the same base (model name, dtype, arguments) sees the same
  ``PeftModel`` and so the same adapters. Adapters are created on demand with a seeded init
  (``A`` drawn from the seed without touching the global RNG, ``B = 0``, so a new adapter leaves
  the model unchanged); creating, resetting or deleting one never changes another. A new
  adapter starts inactive and frozen. :meth:`FoundationModel.use` chooses which adapters take
  part in the forward pass (their deltas add up: ``W0·h + s·B_r·A_r·h + s·B_s·A_s·h``) and which
  receive gradients, and restores the previous choice on exit.
* **Adapter tensors** (:meth:`FoundationModel.get_adapter`, :meth:`FoundationModel.set_adapter`)
  in fedfm's one key format (:mod:`fedfm.models.lora`): peft's saved keys, which never name the
  adapter, so a client's ``global`` state loads into the server's copy, into any adapter of the
  same shape or into plain peft; several adapters in one flat dict are grouped by name
  (``"<adapter>/<key>"``). A message carries exactly the adapters put in it, one array field
  per adapter. Every LLM algorithm reads and writes adapters here, FedIT too (the instruction
  task's :meth:`~fedfm.tasks.base.Task.get_params` is this adapter).
* **Batched, seeded generation** with a chosen adapter set (:meth:`FoundationModel.generate`),
  prompts that keep their tail (:meth:`FoundationModel.prompt`), **all-layer features**
  (:meth:`FoundationModel.features`) and **DP-SGD** on adapters or on every weight, one
  function for both (:meth:`FoundationModel.dp_train` with :class:`Adapters` or
  :class:`FullWeights`).

Adapter slots. In the embedded runtime one process holds one slot per adapter name, shared by
every simulated client and every run of the process. Code reads or trains an adapter only
inside :meth:`FoundationModel.slot`, which loads the tensors it is given (a message's global
adapter, or a client's own one from its :class:`~fedfm.core.state.ClientState`, such as
FedSDR's ``LoRA-S``), or a fresh seeded init for a client that has none yet, and puts back
what the slot held when the block ends. So no code depends on what another client, half or
run left in a slot.

The base models and their adapters sit in one process cache (:mod:`fedfm.fm.bases`); the
causal LMs of the encoder registry read the same shared bases.
"""

from fedfm.fm.bases import base_key, shared_base
from fedfm.fm.handle import Adapters, FoundationModel, FullWeights
from fedfm.models.generation import GenerationConfig, Reply

__all__ = [
    "Adapters",
    "FoundationModel",
    "FullWeights",
    "GenerationConfig",
    "Reply",
    "base_key",
    "shared_base",
]
