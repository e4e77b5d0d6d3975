"""Model loaders (causal LMs, sentence encoders, vision backbones, students) and LoRA helpers.

Kept import-free on purpose: loaders pull in transformers and friends, which are slow to import.
Use ``fedfm.models.registry.build_model`` or import the submodule you need.
"""
