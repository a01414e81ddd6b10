"""The failure board: where the first rank to fail posts what failed, in the rendezvous
store, so that its peers, which see only a broken connection, can name the rank and step;
and how a failing rank breaks its connections so that every peer blocked on it fails at
once."""

from __future__ import annotations

import datetime
from collections.abc import Sequence
from contextlib import suppress
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch.distributed as dist
    from torch.distributed.distributed_c10d import Store

__all__ = ["BREAK_TAG", "FailureBoard", "UnclonableStore", "break_links", "clone_store"]

#: The tag of the receives :func:`break_links` posts: never a transfer's.
BREAK_TAG = 2**31 - 1


class UnclonableStore(Exception):
    """The store cannot give a client a connection of its own (a store written in Python
    without ``clone``, or torch's test ``FakeStore``)."""


def clone_store(store: Store) -> Store:
    """A client of ``store`` with a connection of its own (``Store.clone``, which torch's
    type stubs omit); :class:`UnclonableStore` where the store has none to give."""
    try:
        cloned: Store = store.clone()  # type: ignore[attr-defined]
    except RuntimeError as exc:  # the C++ base's "pure virtual function" clone
        raise UnclonableStore(f"{type(store).__name__}: {exc}") from exc
    return cloned


class FailureBoard:
    """Where the first rank to fail posts what failed, so that its peers, which only see a
    broken connection, can name the rank and step: one key of the rendezvous store per
    communication group. A board spans several groups (a pipeline's and its data-parallel
    one): a failure is posted in each, so it reaches every rank of every group."""

    def __init__(self, stores: Sequence[Store]) -> None:
        self._stores = list(stores)

    def cloned(self) -> FailureBoard:
        """The same board over connections of its own (one per thread: a store client
        holds its lock through a blocking call)."""
        return FailureBoard([clone_store(store) for store in self._stores])

    @staticmethod
    def of(*groups: dist.ProcessGroup) -> FailureBoard:
        """The board of ``groups``, in the rendezvous store."""
        import torch.distributed as dist

        store = dist.distributed_c10d._get_default_store()
        return FailureBoard([dist.distributed_c10d.PrefixStore(f"pipeswap/{group.group_name}/",
                                                               store) for group in groups])

    def post(self, text: str) -> None:
        """Record ``text`` in each group unless another rank's failure came first there."""
        for store in self._stores:
            with suppress(Exception):  # the store may be gone with its rank; peers still fail
                store.compare_set("failed", "", text)

    def read(self) -> str | None:
        """The first failure posted, if any (the first group's first)."""
        for store in self._stores:
            try:
                if store.check(["failed"]):
                    return bytes(store.get("failed")).decode("utf-8", "replace")
            except Exception:  # noqa: BLE001 - no store, no story: the caller says what it saw
                continue
        return None


def break_links(group: dist.ProcessGroup) -> None:
    """Close this rank's connections in ``group`` so that every peer blocked on it fails at
    once instead of at its timeout (gloo closes a connection whose receive timed out)."""
    import torch
    import torch.distributed as dist

    me = dist.get_rank(group)
    for peer in range(dist.get_world_size(group)):
        if peer != me:
            with suppress(Exception):
                work = dist.irecv(torch.zeros(1), dist.get_global_rank(group, peer),
                                  group=group, tag=BREAK_TAG)
                if work is not None:
                    work.wait(datetime.timedelta(milliseconds=1))
