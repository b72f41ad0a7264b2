"""The kernels of an epoch's first collectives are ready before its members meet.

A numba kernel is compiled at its first call when numba's disk cache has no copy of it (a
fresh checkout, an edited kernel): seconds, tens of seconds on a busy host. Made inside a
collective, that time counted against the collective's deadline: an elastic job's epoch 0
failed to form when its members compiled the stream kernel in their first collective (the
host-key all-gather) and the rank whose deadline passed during the compile gave up at its
next quiet poll, while a peer that compiled for longer found every frame waiting and went
on. ``ElasticGroup.start`` now warms the kernels up before the process announces itself
(:func:`bitcoll.bootstrap.warm_up_tcp`).

The check does not depend on timing or on the state of the disk cache: in a fresh
interpreter (no kernel dispatched yet), two members of a job (threads) stop at a barrier
right after their warm-up, each records every specialization that any numba dispatcher
holds (a kernel gets one at its first call, compiled or loaded from the cache), and after
the epoch formed and ran a step they record again: nothing may have been added in between.
"""

from __future__ import annotations

import os
import pathlib
import subprocess
import sys
import textwrap

ROOT = pathlib.Path(__file__).resolve().parent.parent

CHILD = textwrap.dedent("""
    import gc, sys, threading, time

    import numpy as np
    from numba.core.dispatcher import Dispatcher

    from bitcoll import elastic
    from bitcoll.transport.rendezvous.store import StoreClient, StoreServer

    SECRET = b"warm-up-test-secret"
    SIZE = 2


    def specializations():
        return {(d.py_func.__module__, d.py_func.__qualname__, sig)
                for d in gc.get_objects() if isinstance(d, Dispatcher)
                for sig in list(d.overloads)}


    before_any = specializations()
    loaded = threading.Barrier(SIZE)
    seen = {}
    load = elastic._load_kernels


    def load_then_wait():
        load()
        loaded.wait(120)  # every member warmed up; none has announced itself yet
        seen[threading.current_thread().name] = specializations()
        loaded.wait(120)


    elastic._load_kernels = load_then_wait
    server = StoreServer("127.0.0.1", 0, secret=SECRET)
    port = server.port
    errors, after = [], {}
    formed = threading.Barrier(SIZE)


    def member(rank):
        try:
            def connect():
                return StoreClient.connect("127.0.0.1", port, time.monotonic() + 30,
                                           secret=SECRET)

            group = elastic.ElasticGroup.create(connect, SECRET, rank, SIZE, timeout=30.0)
            try:
                group.comm.allreduce(np.ones(1 << 16, np.float32), op="max")
                group.commit(0)
                formed.wait(60)
                after[rank] = specializations()
                formed.wait(60)
            finally:
                group.close()
        except BaseException as exc:
            errors.append(repr(exc))
            formed.abort()


    threads = [threading.Thread(target=member, args=(r,), name=f"member{r}")
               for r in range(SIZE)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(300)
    server.close()
    assert not errors, errors
    assert len(seen) == SIZE and len(after) == SIZE, (seen.keys(), after.keys())
    warmed = seen["member0"]
    assert warmed == seen["member1"]
    streams = {k for k in warmed if k[1] == "run_stream_checked"}
    assert streams - before_any, "the warm-up did not dispatch the stream kernel"
    late = sorted(set().union(*after.values()) - warmed, key=repr)
    assert not late, "kernels first called while the epoch formed: " + repr(late)
    print("ok", len(warmed - before_any))
""")


def test_epoch_formation_dispatches_no_kernel_for_the_first_time() -> None:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(
        [str(ROOT)] + [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]),
        NUMBA_NUM_THREADS="1")
    proc = subprocess.run([sys.executable, "-c", CHILD], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert proc.stdout.startswith("ok"), proc.stdout
