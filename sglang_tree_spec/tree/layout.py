"""Verify layout: everything one target forward needs to score a whole draft tree.

The verify window of request ``b`` has ``D = B + 1`` slots: slot 0 is the root (the bonus token
committed last step, not yet in the KV cache) and slot ``i + 1`` is tree node ``i``. All
functions are batched, fixed-shape and free of host synchronisation.

Layouts defined here:

* ancestor mask ``[bs, D, D]`` bool: ``mask[b, i, j]`` is true iff slot ``j`` is slot ``i`` or
  one of its ancestors (the root is an ancestor of every slot). Row ``i`` is what slot ``i``
  may attend to inside the window; every slot also attends to the whole cached prefix.
* positions ``[bs, D]``: ``prefix_len + depth`` (root depth 0), the RoPE positions of the slots.
* SGLang's EAGLE retrieve arrays, all ``[bs, D]`` int64, indices are slots of the same request:
  ``retrieve_index[b, i] = b * D + i`` (row of slot ``i`` in the flattened ``[bs * D]`` verify
  batch); ``retrieve_next_token[b, i]`` = first child of slot ``i`` (lowest slot), -1 if none;
  ``retrieve_next_sibling[b, i]`` = next sibling of slot ``i`` (next higher slot with the same
  parent), -1 if none. Padding nodes are linked nowhere, so a walk never reaches them.
* SGLang's FULL_MASK custom mask: one flat bool vector; request ``b`` owns a row-major block of
  ``D`` rows by ``prefix_len[b] + D`` columns starting at ``mask_indptr[b]``
  (``mask_indptr = [0, cumsum(D * (prefix_len + D))]``); its first ``prefix_len[b]`` columns are
  true (the cached prefix) and the last ``D`` columns are the ancestor mask rows.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from sglang_tree_spec.tree.ddtree import DraftTree


@dataclass(frozen=True)
class VerifyLayout:
    """Tree-attention inputs for one verify forward. ``D = budget + 1`` slots per request.

    Attributes:
        tokens: ``[bs, D]`` int64, root token then node tokens (padding slots carry 0).
        ancestor_mask: ``[bs, D, D]`` bool, see the module docstring.
        positions: ``[bs, D]`` int64, ``prefix_len + depth``.

    The decode step reads only these; SGLang's EAGLE walk arrays are
    :func:`eagle_retrieve_arrays`, built only by a caller that walks the tree EAGLE's way.
    """

    tokens: torch.Tensor
    ancestor_mask: torch.Tensor
    positions: torch.Tensor


@dataclass(frozen=True)
class EagleRetrieve:
    """SGLang's EAGLE tree-walk arrays, ``[bs, D]`` int64 each (see the module docstring).

    Attributes:
        parent_slots: parent slot of each slot (root: -1, padding: 0).
        depths: depth of each slot (root: 0).
        index: row of each slot in the flattened ``[bs * D]`` verify batch.
        next_token: first child of each slot, -1 if none.
        next_sibling: next sibling of each slot, -1 if none.
    """

    parent_slots: torch.Tensor
    depths: torch.Tensor
    index: torch.Tensor
    next_token: torch.Tensor
    next_sibling: torch.Tensor


def slot_parents(tree: DraftTree) -> torch.Tensor:
    """Parent slot of every window slot. ``[bs, D]``: root -1, node ``i`` -> ``parents[i] + 1``."""
    root = torch.full((tree.batch_size, 1), -1, dtype=torch.long, device=tree.device)
    return torch.cat([root, tree.parents + 1], dim=1)


def ancestor_mask(tree: DraftTree) -> torch.Tensor:
    """``[bs, D, D]`` bool: ``mask[b, i, j]`` iff slot ``j`` is slot ``i`` or its ancestor.

    Pointer doubling: rows start with the ancestors within 1 step; a round ORs in the row of
    the ``2**r``-th ancestor, so coverage goes 1, 3, 7, ... and about ``log2(L)`` rounds of
    ``[bs, D, D]`` work reach depth ``L``.
    """
    bs, d = tree.batch_size, tree.budget + 1
    parent = slot_parents(tree).clamp_min(0)  # root points at itself
    mask = torch.eye(d, dtype=torch.bool, device=tree.device).expand(bs, d, d).clone()
    mask.scatter_(2, parent.unsqueeze(2), True)  # itself and its parent
    jump, covered = parent, 1  # jump: [bs, D] ancestor 2**r steps up (the root saturates)
    while covered < tree.max_depth:
        jump = jump.gather(1, jump)
        mask |= mask.gather(1, jump.unsqueeze(2).expand(bs, d, d))
        covered = 2 * covered + 1
    return mask


@dataclass(frozen=True)
class SiblingGroups:
    """Window slots grouped by parent, slots ascending within a group. All ``[bs, D]``.

    ``order`` lists the slots group by group; ``group[b, n]`` is the parent slot of
    ``order[b, n]`` (``D`` for slots linked to no parent: the root and padding);
    ``is_first[b, n]`` marks the first slot of each real group.
    """

    order: torch.Tensor
    group: torch.Tensor
    is_first: torch.Tensor

    @property
    def is_linked(self) -> torch.Tensor:
        return self.group < self.group.shape[1]

    def exclusive_cumsum(self, values_in_order: torch.Tensor) -> torch.Tensor:
        """Sum of ``values_in_order`` over the earlier members of each group, ``[bs, D]``."""
        inclusive = values_in_order.cumsum(dim=1)
        exclusive = inclusive - values_in_order
        n = torch.arange(self.order.shape[1], device=self.order.device).expand_as(self.order)
        group_start = torch.where(self.is_first, n, 0).cummax(dim=1).values
        return exclusive - exclusive.gather(1, group_start)


def group_siblings(parent_slots: torch.Tensor, valid: torch.Tensor) -> SiblingGroups:
    """Group window slots by parent.

    Args:
        parent_slots: ``[bs, D]`` parent slot of each slot, root -1.
        valid: ``[bs, D]`` bool, false for padding slots (grouped apart, linked to nothing).
    """
    bs, d = parent_slots.shape
    slots = torch.arange(d, device=parent_slots.device).expand(bs, d)
    group = torch.where(valid & (parent_slots >= 0), parent_slots, d)
    order = (group * d + slots).argsort(dim=1)
    sorted_group = group.gather(1, order)
    is_first = torch.ones_like(order, dtype=torch.bool)
    is_first[:, 1:] = sorted_group[:, 1:] != sorted_group[:, :-1]
    return SiblingGroups(order=order, group=sorted_group, is_first=is_first & (sorted_group < d))


def sibling_links(groups: SiblingGroups) -> tuple[torch.Tensor, torch.Tensor]:
    """First-child and next-sibling arrays over window slots (EAGLE convention).

    Returns:
        ``(first_child, next_sibling)``, both ``[bs, D]`` int64 slots or -1. Slots linked to no
        parent (the root, padding) are nobody's child or sibling.
    """
    order, group = groups.order, groups.group
    bs, d = order.shape
    same_next = (group[:, 1:] == group[:, :-1]) & groups.is_linked[:, 1:]
    next_sibling = torch.full_like(order, -1)
    next_sibling.scatter_(1, order[:, :-1], torch.where(same_next, order[:, 1:], -1))
    first_child = torch.full((bs, d + 1), -1, dtype=torch.long, device=order.device)
    target = torch.where(groups.is_first, group, d)  # column d: discarded
    first_child.scatter_(1, target, torch.where(groups.is_first, order, -1))
    return first_child[:, :d], next_sibling


def window_valid(tree: DraftTree) -> torch.Tensor:
    """``[bs, D]`` bool: the root and the valid nodes."""
    root = torch.ones(tree.batch_size, 1, dtype=torch.bool, device=tree.device)
    return torch.cat([root, tree.valid], dim=1)


def build_verify_layout(
    tree: DraftTree, root_tokens: torch.Tensor, prefix_lens: torch.Tensor
) -> VerifyLayout:
    """Lay a batch of draft trees out for one tree-attention verify forward.

    Args:
        tree: ``[bs, B]`` draft trees.
        root_tokens: ``[bs]`` int64 bonus tokens (slot 0).
        prefix_lens: ``[bs]`` int64 tokens already in each request's KV cache.
    """
    bs = tree.batch_size
    root = root_tokens.view(bs, 1).to(torch.long)
    if tree.budget == 0:  # a plain step: the root alone, which sees itself
        mask = torch.ones(bs, 1, 1, dtype=torch.bool, device=root.device)
        positions = prefix_lens.to(torch.long).view(bs, 1).clone()
        return VerifyLayout(tokens=root.clone(), ancestor_mask=mask, positions=positions)
    tokens = torch.cat([root, tree.tokens], dim=1)
    return VerifyLayout(
        tokens=tokens,
        ancestor_mask=ancestor_mask(tree),
        positions=prefix_lens.view(bs, 1).to(torch.long) + slot_depths(tree),
    )


def slot_depths(tree: DraftTree) -> torch.Tensor:
    """``[bs, D]`` int64 depth of every window slot (root 0)."""
    root = torch.zeros(tree.batch_size, 1, dtype=torch.long, device=tree.device)
    return torch.cat([root, tree.depths], dim=1)


def eagle_retrieve_arrays(tree: DraftTree) -> EagleRetrieve:
    """SGLang's EAGLE walk arrays for ``[bs, B]`` trees (for a verifier that walks them)."""
    bs, d = tree.batch_size, tree.budget + 1
    parents = slot_parents(tree)
    first_child, next_sibling = sibling_links(group_siblings(parents, window_valid(tree)))
    return EagleRetrieve(
        parent_slots=parents,
        depths=slot_depths(tree),
        index=torch.arange(bs * d, device=tree.device).view(bs, d),
        next_token=first_child,
        next_sibling=next_sibling,
    )


def full_mask_indptr(prefix_lens: torch.Tensor, window: int) -> torch.Tensor:
    """``[bs + 1]`` int64 start of each request's block in the flat FULL_MASK vector."""
    sizes = window * (prefix_lens.to(torch.long) + window)
    return torch.nn.functional.pad(sizes.cumsum(0), (1, 0))


def write_full_mask(
    tree_mask: torch.Tensor, prefix_lens: torch.Tensor, out: torch.Tensor
) -> torch.Tensor:
    """Write SGLang's flat FULL_MASK custom mask into a preallocated buffer, on device.

    The prefix part is one fill of the buffer (no per-request host loop, no host sync); only
    the ``bs * D * D`` tree entries are scattered. The buffer must hold at least
    ``sum(D * (prefix_len + D))`` entries; entries past that are left true.

    Args:
        tree_mask: ``[bs, D, D]`` bool ancestor mask.
        prefix_lens: ``[bs]`` int64 cached prefix length of each request.
        out: 1-D bool buffer, written in place.

    Returns:
        ``mask_indptr`` ``[bs + 1]`` int64.
    """
    d = tree_mask.shape[1]
    indptr = full_mask_indptr(prefix_lens, d)
    row_len = prefix_lens.to(torch.long) + d  # [bs]
    rows = torch.arange(d, device=out.device)
    # Flat index of (b, row i, tree column j) = indptr[b] + i * row_len[b] + prefix_len[b] + j.
    row_start = indptr[:-1, None] + rows[None, :] * row_len[:, None] + prefix_lens[:, None]
    index = row_start.unsqueeze(2) + rows.view(1, 1, d)  # [bs, D, D]
    out.fill_(True)
    out.index_put_((index.flatten(),), tree_mask.flatten())
    return indptr
