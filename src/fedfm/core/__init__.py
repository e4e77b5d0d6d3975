"""The core every algorithm and runtime builds on.

The federation interface, messages and audit, aggregation and server optimizers, local
training, KD losses, client state and checkpoints.
"""
