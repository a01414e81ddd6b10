"""The peer watch that makes a failure visible where operations do not fail by themselves
(NCCL): real threads over a real store, in one process; NCCL's group a test double that
records its abort."""

from __future__ import annotations

import sys
import threading
import time
from collections.abc import Callable
from contextlib import suppress
from pathlib import Path
from typing import Any

import pytest
import torch.distributed as dist
from torch.distributed.distributed_c10d import PrefixStore, Store

from pipeswap.runtime.distributed import peer_watch as watch
from pipeswap.runtime.distributed.failure_board import FailureBoard, UnclonableStore, clone_store
from pipeswap.runtime.distributed.process_groups import only_gloo, operation_timeout
from pipeswap.runtime.distributed.peer_watch import PeerWatch

TIMEOUT_S = 0.3
LIMIT_S = 20.0  # what a watch that should act gets before the test gives up


class Found:
    """The failures a watch reported, and an event for the first."""

    def __init__(self) -> None:
        self.texts: list[str] = []
        self.event = threading.Event()

    def __call__(self, text: str) -> None:
        self.texts.append(text)
        self.event.set()


def beats(store: Store, rank: int) -> int:
    return int(PrefixStore("pipeswap/beats/", store).add(str(rank), 0))


def until(condition: Callable[[], bool]) -> None:
    """Wait for ``condition`` (checked on the watch's own clock of beats)."""
    deadline = time.monotonic() + LIMIT_S
    while not condition():
        assert time.monotonic() < deadline, "the condition never came"
        threading.Event().wait(0.01)


@pytest.fixture
def store() -> Store:
    made: Store = dist.HashStore()  # type: ignore[attr-defined]  # not in torch's __all__
    return made


def test_a_silent_neighbour_is_posted_and_reported(store: Store) -> None:
    board = FailureBoard([PrefixStore("pipeline/", store)])
    found = Found()
    start = time.monotonic()
    me = PeerWatch(0, [1, 0], TIMEOUT_S, found, store=store)
    me.arm(board)
    assert found.event.wait(LIMIT_S)
    me.close()
    assert time.monotonic() - start >= TIMEOUT_S
    assert found.texts == [board.read()] and found.texts[0].startswith(
        "rank 1 stopped answering: no sign of life for 0.3 s")
    assert me.reason == found.texts[0]


def test_a_beating_neighbour_is_never_reported(store: Store) -> None:
    """A live rank's own thread beats whatever its step does, so however long the step,
    its neighbour's watch stays quiet."""
    board = FailureBoard([PrefixStore("pipeline/", store)])
    found, other = Found(), Found()
    me = PeerWatch(0, [1], TIMEOUT_S, found, store=store)
    peer = PeerWatch(1, [0], TIMEOUT_S, other, store=store)
    me.arm(board)
    peer.arm(board)
    until(lambda: beats(store, 0) >= 50)  # five timeouts of beats
    me.close()
    peer.close()
    assert found.texts == other.texts == [] and board.read() is None


def test_a_posted_failure_is_reported_to_every_watch(store: Store) -> None:
    board = FailureBoard([PrefixStore("pipeline/", store)])
    found = Found()
    me = PeerWatch(0, [], TIMEOUT_S, found, store=store)
    me.arm(board)
    board.post("rank 3 failed at F2 of step 1: ValueError: boom")
    assert found.event.wait(LIMIT_S)
    me.close()
    assert found.texts == ["rank 3 failed at F2 of step 1: ValueError: boom"]


def test_between_steps_it_only_beats(store: Store) -> None:
    """Disarmed (no step running), a silent neighbour and a posted failure wait for the
    next step."""
    board = FailureBoard([PrefixStore("pipeline/", store)])
    found = Found()
    me = PeerWatch(0, [1], TIMEOUT_S, found, store=store)
    until(lambda: beats(store, 0) >= 20)  # twice the timeout, disarmed
    assert found.texts == []
    me.arm(board)
    assert found.event.wait(LIMIT_S)
    me.disarm()
    me.close()
    assert found.texts[0].startswith("rank 1 stopped answering")


class FakeNcclGroup:
    """Stands in for an NCCL group: its abort is what a failed peer's blocked operations
    wait for."""

    def __init__(self) -> None:
        self.aborted = threading.Event()
        self.group_name = "fake-nccl"

    def abort(self) -> None:
        self.aborted.set()

    def _get_backend(self, device: Any) -> Any:
        raise RuntimeError(f"no backend for {device}")  # as torch says of one it lacks


def test_on_nccl_a_failure_aborts_the_group_and_its_blocked_wait_returns(
        store: Store, monkeypatch: pytest.MonkeyPatch) -> None:
    """stop_groups aborts a group that is not gloo alone (and breaks no gloo links in a
    group without a CPU backend); here the watch's abort ends a wait that only the abort
    can end, as NCCL's blocked operations return once their communicator is aborted."""
    group = FakeNcclGroup()
    broken: list[Any] = []
    monkeypatch.setattr(dist, "get_backend_config", lambda g: "cuda:nccl")
    monkeypatch.setattr(watch, "device_types", lambda g: ["cuda"])
    monkeypatch.setattr(watch, "break_links", broken.append)
    board = FailureBoard([PrefixStore("pipeline/", store)])
    me = PeerWatch(0, [1], TIMEOUT_S, lambda text: watch.stop_groups([group]),  # type: ignore[list-item]
                   store=store)
    me.arm(board)
    assert group.aborted.wait(LIMIT_S)  # the blocked operation's release
    me.close()
    assert broken == [] and me.reason is not None


def test_timeouts_of_a_watched_group() -> None:
    """A watched group's operations wait long on every backend: a slow peer still beats,
    and only the watch fails a silent one."""
    minute = 60.0
    assert operation_timeout(_seconds(minute)).total_seconds() == 30 * minute
    assert operation_timeout(_seconds(10 * minute)).total_seconds() == 100 * minute
    assert only_gloo("cpu:gloo,cuda:gloo") and not only_gloo("cpu:gloo,cuda:nccl")
    assert not only_gloo("cuda:nccl")


class NcclCalls:
    """Stands in for NCCL's group calls (``ncclGroupStart``/``End``): a count per thread,
    and a log of what ran inside."""

    def __init__(self) -> None:
        self.depth = 0
        self.log: list[str] = []

    def _group_start(self) -> None:
        self.depth += 1
        self.log.append("start")

    def _group_end(self) -> None:
        self.depth -= 1
        self.log.append("end")


class FakeNcclBackendGroup(FakeNcclGroup):
    """An NCCL group whose backend has the group calls, and whose abort is logged."""

    def __init__(self, calls: NcclCalls, name: str) -> None:
        super().__init__()
        self.calls, self.group_name = calls, name

    def _get_backend(self, device: Any) -> NcclCalls:
        return self.calls

    def abort(self) -> None:
        self.calls.log.append(f"abort {self.group_name}")
        super().abort()


def test_communicators_are_aborted_together(monkeypatch: pytest.MonkeyPatch) -> None:
    """Every NCCL group is aborted inside one group call, as torch aborts its own, so that
    no abort waits behind another communicator's hung kernel."""
    calls = NcclCalls()
    first, second = FakeNcclBackendGroup(calls, "a"), FakeNcclBackendGroup(calls, "b")
    monkeypatch.setattr(dist, "get_backend_config", lambda g: "cuda:nccl")
    monkeypatch.setattr(watch, "device_types", lambda g: ["cuda"])
    watch.stop_groups([first, None, second])  # type: ignore[list-item]
    assert calls.log == ["start", "abort a", "abort b", "end"] and calls.depth == 0


def test_a_stopper_remembers_and_is_renewed(monkeypatch: pytest.MonkeyPatch) -> None:
    calls = NcclCalls()
    old, fresh = FakeNcclBackendGroup(calls, "old"), FakeNcclBackendGroup(calls, "new")
    monkeypatch.setattr(dist, "get_backend_config", lambda g: "cuda:nccl")
    monkeypatch.setattr(watch, "device_types", lambda g: ["cuda"])
    stopper = watch.GroupStopper([old])  # type: ignore[list-item]
    assert not stopper.stopped
    stopper.stop("rank 1 stopped answering")
    assert stopper.stopped and old.aborted.is_set()
    stopper.renew(fresh)
    assert not stopper.stopped and stopper.groups == [fresh]


def _seconds(value: float) -> Any:
    import datetime

    return datetime.timedelta(seconds=value)


def test_close_frees_accelerator_groups_and_leaves_gloo_ones(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """An executor's NCCL groups are destroyed where they span the world and shut down
    (their work finished, their memory freed, their names kept) where they do not, never
    aborted; gloo groups are left as they are."""
    from pipeswap.runtime.distributed.process_groups import free_groups

    class Closing(FakeNcclGroup):
        def __init__(self) -> None:
            super().__init__()
            self.shut = False

        def shutdown(self) -> None:
            self.shut = True

    nccl, gloo = Closing(), Closing()
    destroyed: list[Any] = []
    monkeypatch.setattr(dist, "get_backend_config",
                        lambda g: "cpu:gloo,cuda:gloo" if g is gloo else "cpu:gloo,cuda:nccl")
    monkeypatch.setattr(dist, "destroy_process_group", destroyed.append)
    free_groups([nccl, gloo, None], spans_world=True)  # type: ignore[list-item]
    assert destroyed == [nccl] and not nccl.shut
    free_groups([nccl, gloo], spans_world=False)  # type: ignore[list-item]
    assert destroyed == [nccl] and nccl.shut and not nccl.aborted.is_set()
    assert not gloo.shut and not gloo.aborted.is_set()


class _NoClone(Store):
    """A store written in Python that gives no client a connection of its own."""


def test_a_store_without_clone_is_named() -> None:
    with pytest.raises(UnclonableStore, match="_NoClone"):
        clone_store(_NoClone())


def test_without_a_store_to_clone_the_executor_runs_unwatched_and_says_so(
        group: None, monkeypatch: pytest.MonkeyPatch) -> None:
    """A group whose store cannot be cloned (the watch's connections) still trains: one
    warning says no watch runs, and the step runs as it would without one. (The rank is
    alone here, so it is given a neighbour to watch; alone, it watches nobody and says
    nothing.)"""
    import warnings

    import torch

    from pipeswap.runtime import FailureHandling, PipelineExecutor, PipelineStage
    from pipeswap.runtime.executor import pipeline_executor, setup

    def unwatched(*args: Any, **kwargs: Any) -> PeerWatch:
        raise UnclonableStore("_NoClone: no clone")

    monkeypatch.setattr(pipeline_executor, "PeerWatch", unwatched)
    torch.manual_seed(0)
    stage = PipelineStage(torch.nn.Sequential(torch.nn.Linear(4, 4)), 0, 1)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # alone: no watch, and no word of one
        PipelineExecutor([stage], "gpipe", 2, torch.nn.functional.mse_loss,
                         failure=FailureHandling(timeout_s=5)).close()
    monkeypatch.setattr(setup, "neighbours", lambda *args: [1])
    with pytest.warns(UserWarning, match="no peer watch runs, as the rendezvous store cannot"):
        executor = PipelineExecutor([stage], "gpipe", 2, torch.nn.functional.mse_loss,
                                    failure=FailureHandling(timeout_s=5))
    report = executor.step(torch.randn(4, 4), torch.randn(4, 4))
    assert len(report.losses) == 2
    executor.close()


def _listening(port: int) -> set[str]:
    """The local addresses (hex, as /proc/net/tcp writes them) listening on ``port``."""
    found = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        with suppress(OSError), open(table) as lines:
            for line in list(lines)[1:]:
                local, state = line.split()[1], line.split()[3]
                address, at = local.split(":")
                if int(at, 16) == port and state == "0A":  # LISTEN
                    found.add(address)
    return found


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc/net/tcp")
def test_the_launchers_store_listens_on_loopback_only() -> None:
    """The rendezvous store spawn serves (in the launcher, so no rank holds it) takes
    connections on 127.0.0.1 alone: nothing off this host can set or read its keys."""
    from datetime import timedelta

    from pipeswap.runtime.distributed.launch import _served_store

    with _served_store(1, 5.0) as port:
        assert _listening(port) == {"0100007F"}
        client = dist.TCPStore(  # type: ignore[attr-defined]
            "127.0.0.1", port, is_master=False, timeout=timedelta(seconds=5))
        client.set("key", "value")
        assert client.get("key") == b"value"
    assert _listening(port) == set()  # gone with the block


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
def test_a_silent_neighbour_that_runs_on_this_host_is_busy_until_stopped(store: Store) -> None:
    """A neighbour whose beats stop but whose process runs (its interpreter lock held by
    one long call, say) is busy, not gone: never reported, however long; stopped (SIGSTOP)
    it is reported as such, and a vanished one as gone."""
    import signal
    import socket
    import subprocess

    for ending, said in ((signal.SIGSTOP, "is stopped: SIGSTOP, or a debugger"),
                         (signal.SIGKILL, "is gone")):
        board = FailureBoard([PrefixStore(f"pipeline-{ending}/", store)])  # a step's own
        busy = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])
        try:
            PrefixStore("pipeswap/beats/", store).set(
                "where/1", f"{socket.gethostname()} {busy.pid}")  # posted, never beating
            found = Found()
            me = PeerWatch(0, [1], TIMEOUT_S, found, store=store)
            me.arm(board)
            until(lambda: beats(store, 0) >= 30)  # three timeouts of silence, as busy
            assert found.texts == []
            busy.send_signal(ending)
            if ending == signal.SIGKILL:
                busy.wait()
            assert found.event.wait(LIMIT_S)
            me.close()
            assert found.texts[0].startswith(
                "rank 1 stopped answering: no sign of life for 0.3 s (its process "
                f"{busy.pid} on this host {said}"), found.texts
        finally:
            busy.kill()
            busy.wait()


_HOLDS_THE_LOCK = """
import datetime, sys, time
import torch.distributed as dist
from pipeswap.runtime.distributed.peer_watch import PeerWatch
store = dist.TCPStore("127.0.0.1", int(sys.argv[1]), is_master=False,
                      timeout=datetime.timedelta(seconds=30))
watch = PeerWatch(1, [0], float(sys.argv[2]), lambda text: None, store=store)
print("ready", flush=True)
sys.stdin.readline()
sum(range(int(sys.argv[3])))  # one call that holds the interpreter lock throughout
print("done", flush=True)
time.sleep(120)
"""


def _process_beats_of(pid: int) -> list[int]:
    """The process beats running for process ``pid``."""
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            with suppress(OSError):
                args = (entry / "cmdline").read_bytes().split(b"\0")
                if b"pipeswap.runtime.distributed.process_beat" in args and \
                        args[args.index(b"pipeswap.runtime.distributed.process_beat") + 1] \
                        == str(pid).encode():
                    found.append(int(entry.name))
    return found


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
def test_a_neighbour_on_another_host_holding_the_lock_still_beats_until_stopped() -> None:
    """A rank whose neighbour runs on another host beats from a process of its own too: its
    watch thread silent while one long call holds the interpreter lock, it is not reported
    however long; stopped (SIGSTOP) it is, within about the timeout; killed, its process beat
    ends with it."""
    import datetime
    import signal
    import subprocess

    master = dist.TCPStore(  # type: ignore[attr-defined]
        "127.0.0.1", 0, is_master=True, timeout=datetime.timedelta(seconds=30))
    beats_of = PrefixStore("pipeswap/beats/", master)
    found = Found()
    me = PeerWatch(0, [1], 0.5, found, store=master)
    beats_of.set("where/0", "another-host 1")  # as rank 1 sees this rank
    board = FailureBoard([PrefixStore("pipeline/", master)])
    child = subprocess.Popen([sys.executable, "-c", _HOLDS_THE_LOCK, str(master.port), "0.5",
                              str(2 * 10**8)], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                             text=True)
    try:
        assert child.stdout is not None and child.stdin is not None
        assert child.stdout.readline().strip() == "ready"
        beats_of.set("where/1", f"a-third-host {child.pid}")  # judged by its beats alone
        until(lambda: int(master.add("pipeswap/process-beat/1", 0)) > 0)
        me.arm(board)
        before = beats(master, 1)
        child.stdin.write("go\n")
        child.stdin.flush()
        assert child.stdout.readline().strip() == "done"
        assert beats(master, 1) - before <= 3, "the call did not hold the lock: no test"
        assert found.texts == []  # silent thread, beating process: busy, not failed
        child.send_signal(signal.SIGSTOP)
        assert found.event.wait(LIMIT_S)
        assert found.texts[0].startswith("rank 1 stopped answering: no sign of life for 0.5 s")
        helpers = _process_beats_of(child.pid)
        assert len(helpers) == 1
        child.kill()
        child.wait()
        until(lambda: not _process_beats_of(child.pid))
    finally:
        me.close()
        if child.poll() is None:
            child.kill()
            child.wait()
