"""Named groups of tensors in one flat dict: ``"<group>/<name>" -> tensor``.

Checkpoints and client states store several tensor dicts (parameters, optimizer state,
control variates) side by side in one flat dict, as safetensors needs; these helpers put
groups in and take them out by name, so no caller slices key prefixes by hand.
"""

from __future__ import annotations

from collections.abc import Mapping

from torch import Tensor


def get_group(arrays: Mapping[str, Tensor], group: str) -> dict[str, Tensor]:
    """The tensors stored under ``group/``, with the group prefix removed.

    Args:
        arrays: A flat dict of grouped tensors.
        group: The group's name (no trailing slash).

    Returns:
        ``{name: tensor}`` for every key ``group/name``; empty when the group is absent.
    """
    p = group + "/"
    return {k[len(p) :]: v for k, v in arrays.items() if k.startswith(p)}


def join_groups(groups: Mapping[str, Mapping[str, Tensor]]) -> dict[str, Tensor]:
    """One flat dict of several named groups: ``{"params": {"w": t}} -> {"params/w": t}``.

    Args:
        groups: Group name -> tensors.

    Returns:
        The flat dict (the inverse of :func:`get_group` for each group).
    """
    return {f"{g}/{k}": v for g, tensors in groups.items() for k, v in tensors.items()}
