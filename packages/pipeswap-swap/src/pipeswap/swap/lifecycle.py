"""A swap manager's groups by name and their life: created, offloaded, loaded back, loaded
ahead of the backward, finished or aborted.

Each call checks the group's state (:func:`~pipeswap.swap.group_state.expect`) and leaves the
copies to :mod:`pipeswap.swap.transfers`; what autograd saves into the groups is
:mod:`pipeswap.swap.collection`'s, and :class:`~pipeswap.swap.SwapManager` is the whole.
"""

from __future__ import annotations

import threading
import weakref
from collections.abc import Sequence

from pipeswap.platform import Platform
from pipeswap.swap.group_state import Group, expect
from pipeswap.swap.ledger import Ledger
from pipeswap.swap.transfers import Transfers, drain
from pipeswap.swap.values import GroupState, SwapError, check_load_depth


class GroupLifecycle:
    """The groups of one manager by name, the tables that name them (which group saved a
    storage, which groups form a chain, which load ahead), and every call that moves a group
    from one state to the next."""

    def __init__(self, platform: Platform, pool_bytes: int | None) -> None:
        self.platform = platform
        self._ledger = Ledger()
        self._transfers = Transfers(platform, pool_bytes, self._ledger)
        self._lock = threading.RLock()
        self._groups: dict[str, Group] = {}
        self._owner: dict[int, str] = {}  # storage key -> group that saved it
        # group -> the group its first read in backward loads ahead (None: none); see
        # load_ahead
        self._ahead: dict[str, str | None] = {}
        self._chains: dict[str, int] = {}  # group -> its chain (see link_groups)
        self._next_chain = 0
        # A copy still running when the interpreter exits aborts the process: drain first.
        self._drain = weakref.finalize(self, drain, self._transfers.streams)

    def close(self) -> None:
        """Wait for every transfer in flight (also done at interpreter exit). Each call
        drains: the manager stays usable, and the exit's drain stays armed."""
        drain(self._transfers.streams)

    # -- groups ----------------------------------------------------------------------------

    def ensure_group(self, name: str) -> None:
        with self._lock:
            if name not in self._groups:
                self._groups[name] = Group(name)

    def active_group_count(self) -> int:
        with self._lock:
            return len(self._groups)

    def group_state(self, name: str) -> GroupState:
        return self._group(name, "group_state").state

    def _group(self, name: str, call: str) -> Group:
        with self._lock:
            group = self._groups.get(name)
        if group is None:
            raise SwapError(f"{call}({name!r}): no such group; create it with ensure_group() or "
                            "group_context()")
        return group

    def link_groups(self, names: Sequence[str]) -> None:
        """Make ``names`` (one forward's per-layer groups, in order) one chain: a storage a
        group saved that a later group of the chain saves again (a layer's output, saved by
        the op that made it and by the next layer's first op) moves to the later group, which
        leaves the device later and comes back earlier, instead of staying on the device."""
        with self._lock:
            self._next_chain += 1
            for name in names:
                self._group(name, "link_groups")
                self._chains[name] = self._next_chain

    def _chained(self, owner: Group, group: Group) -> bool:
        """Whether ``group`` may take a storage ``owner`` saved: same chain, and the owner
        has not released anything yet."""
        chain = self._chains.get(owner.name)
        return (chain is not None and chain == self._chains.get(group.name)
                and owner.state in (GroupState.COLLECTING, GroupState.OFFLOADING))

    def load_ahead(self, names: Sequence[str], depth: int = 1) -> None:
        """Stream a backward's loads: when backward first reads a saved activation of
        ``names[k]``, that group is made resident (its load waited for, or done then if none
        was launched) and the load of ``names[k - depth]`` is launched, so each copy overlaps
        the backward of the ``depth`` groups after it (one more resident per ``depth`` over
        1). ``names``: a forward's groups in the order it saved them (one per layer); launch
        the last ``depth`` loads yourself. With a name missing or ``depth`` not 1 to
        ``len(names)``, it raises and arms none."""
        check_load_depth(depth, len(names), "load_ahead: depth")
        with self._lock:
            for name in names:
                self._group(name, "load_ahead")
            for index, name in enumerate(names):
                self._ahead[name] = names[index - depth] if index >= depth else None

    def _first_read(self, group: Group) -> None:
        """Backward reached ``group`` for the first time (see :meth:`load_ahead`)."""
        with self._lock:
            if group.name not in self._ahead:  # another thread got here first
                return
            ahead = self._ahead[group.name]
            self._make_resident(group)
            del self._ahead[group.name]
            following = self._groups.get(ahead) if ahead is not None else None
            if following is not None:
                if following.state is GroupState.OFFLOADING:
                    self.wait_offload(following.name)
                if following.state is GroupState.OFFLOADED:
                    self.launch_load(following.name)

    def _make_resident(self, group: Group) -> None:
        if group.state is GroupState.OFFLOADING:
            self._transfers.stop_offload(group)
        if group.state is GroupState.OFFLOADED:
            self.launch_load(group.name)
        if group.state is GroupState.LOADING:
            self.wait_load(group.name)

    # -- transfers -------------------------------------------------------------------------

    def launch_offload(self, name: str, *, copy_referenced: bool = False) -> None:
        """Start copying the group's storages to host memory on the D2H stream; a storage that
        something outside the saved activations references is not copied (it cannot be
        freed), unless ``copy_referenced``: for a group launched while the forward still
        holds its last tensors (a layer's input, in a per-layer group), which
        :meth:`wait_offload` checks again before freeing."""
        group = self._group(name, "launch_offload")
        with self._lock:
            expect(group, "launch_offload", GroupState.COLLECTING)
            self._transfers.launch_offload(group, copy_referenced=copy_referenced)

    def wait_offload(self, name: str, *, defer_referenced: bool = False) -> None:
        """Make compute wait for the offload, then release the group's device storage (what
        is still unreferenced outside the saved activations: the check is made again here).
        With ``defer_referenced``, a storage still referenced keeps its host copy and waits,
        without a warning, for :meth:`release_deferred` (a per-layer group freed while the
        forward runs, whose tensors its caller may still hold: autocast's cast weights)."""
        group = self._group(name, "wait_offload")
        with self._lock:
            expect(group, "wait_offload", GroupState.OFFLOADING)
            self._transfers.wait_offload(group, defer_referenced=defer_referenced)

    def release_deferred(self, name: str) -> None:
        """Release what :meth:`wait_offload` deferred in an offloaded group, now that nothing
        else references it; what is still referenced stays on the device (with a warning)."""
        group = self._group(name, "release_deferred")
        with self._lock:
            expect(group, "release_deferred", GroupState.OFFLOADED)
            self._transfers.release_deferred(group)

    def launch_load(self, name: str) -> None:
        """Re-allocate the group's storages and start copying them back on the H2D stream."""
        group = self._group(name, "launch_load")
        with self._lock:
            if group.state is GroupState.OFFLOADING:
                raise SwapError(f"launch_load({name!r}): group is offloading; call "
                                "wait_offload first (load before the offload finished)")
            expect(group, "launch_load", GroupState.OFFLOADED)
            self._transfers.launch_load(group)

    def wait_load(self, name: str) -> None:
        """Make compute wait for the load; the activations are usable again."""
        group = self._group(name, "wait_load")
        with self._lock:
            expect(group, "wait_load", GroupState.LOADING)
            self._transfers.wait_load(group)

    def finish_group(self, name: str) -> None:
        """Forget a group whose activations are resident (after its backward)."""
        group = self._group(name, "finish_group")
        with self._lock:
            expect(group, "finish_group", GroupState.RESIDENT, GroupState.COLLECTING)
            self._drop(group, GroupState.DONE)

    def abort_group(self, name: str) -> None:
        """Stop whatever the group is doing: wait for its transfers, put every freed storage
        back on the device, return every host buffer, forget the group. Missing: no-op."""
        with self._lock:
            group = self._groups.get(name)
            if group is None:
                return
            try:
                self._transfers.abort(group)
            finally:  # a failed copy raised: still forget the group
                self._drop(group, GroupState.ABORTED)

    def end_group(self, name: str) -> None:
        """Forget a group after its backward, whatever its state: a per-layer group whose
        tensors backward never read may still be offloaded; what of it is still alive comes
        back first (another backward may yet read it)."""
        group = self._group(name, "end_group")
        if group.state is GroupState.LOADING:
            self.wait_load(name)
        if group.state in (GroupState.RESIDENT, GroupState.COLLECTING):
            self.finish_group(name)
        else:
            self.abort_group(name)

    def _drop(self, group: Group, state: GroupState) -> None:
        self._ahead.pop(group.name, None)
        self._chains.pop(group.name, None)
        for key, entry in group.storages.items():
            self._ledger.uncount(entry)
            if self._owner.get(key) == group.name:
                del self._owner[key]
        group.state = state
        group.storages.clear()
        del self._groups[group.name]
