"""Prototype: single-threaded native (numba, nogil) fused ring all-reduce over the transport's
sockets, against gloo, alternating rounds. Run under bench/netbed.py."""
import ctypes, os, sys, time
import numpy as np
import numba as nb
sys.path.insert(0, "bench")
import osu, osu_allreduce

libc = ctypes.CDLL(None)
c_recv = libc.recv; c_recv.argtypes = [ctypes.c_int, ctypes.c_size_t, ctypes.c_size_t, ctypes.c_int]; c_recv.restype = ctypes.c_ssize_t
c_send = libc.send; c_send.argtypes = [ctypes.c_int, ctypes.c_size_t, ctypes.c_size_t, ctypes.c_int]; c_send.restype = ctypes.c_ssize_t
c_poll = libc.poll; c_poll.argtypes = [ctypes.c_size_t, ctypes.c_size_t, ctypes.c_int]; c_poll.restype = ctypes.c_int
DONTWAIT = 0x40; NOSIGNAL = 0x4000
POLLIN = 1; POLLOUT = 4

@nb.njit(nogil=True, cache=False)
def ring(work, bounds, rank, p, seg, lfd, rfd, bounce, pfd):
    # segments queue: send list and recv list, fused RS+AG
    nseg_max = 4096
    s_off = np.empty(nseg_max, np.int64); s_len = np.empty(nseg_max, np.int64)
    r_off = np.empty(nseg_max, np.int64); r_len = np.empty(nseg_max, np.int64)
    r_kind = np.empty(nseg_max, np.int64)  # 0 RS forward, 1 RS final (->AG send), 2 AG forward, 3 AG final
    ns = 0; nr = 0
    b0 = (rank - 1) % p
    a = bounds[b0]; z = bounds[b0 + 1]
    x = a
    while x < z:
        y = min(x + seg, z); s_off[ns] = x; s_len[ns] = y - x; ns += 1; x = y
    for s in range(p - 1):
        rb = (b0 - s - 1) % p
        x = bounds[rb]; z = bounds[rb + 1]
        while x < z:
            y = min(x + seg, z); r_off[nr] = x; r_len[nr] = y - x
            r_kind[nr] = 0 if s < p - 2 else 1; nr += 1; x = y
    for t in range(p - 1):
        rb = (rank - t - 1) % p
        x = bounds[rb]; z = bounds[rb + 1]
        while x < z:
            y = min(x + seg, z); r_off[nr] = x; r_len[nr] = y - x
            r_kind[nr] = 2 if t < p - 2 else 3; nr += 1; x = y
    base = work.ctypes.data
    bb = bounce.ctypes.data
    piece = bounce.size  # elements
    si = 0; sdone = 0  # current send index, bytes done of it
    ri = 0; rdone = 0; fill = 0
    pdata = pfd.ctypes.data
    while si < ns or ri < nr:
        # try to progress without poll first
        progressed = True
        while progressed:
            progressed = False
            if si < ns:
                n = s_len[si] * 4 - sdone
                k = c_send(rfd, base + s_off[si] * 4 + sdone, n, DONTWAIT | NOSIGNAL)
                if k > 0:
                    progressed = True
                    sdone += k
                    if sdone == s_len[si] * 4:
                        si += 1; sdone = 0
            if ri < nr:
                kind = r_kind[ri]
                if kind < 2:
                    # reduce: into bounce then add
                    start = r_off[ri] * 4 + rdone  # byte pos in work
                    want = min(piece * 4, r_len[ri] * 4 - rdone)
                    k = c_recv(lfd, bb + fill, want - fill, DONTWAIT)
                    if k > 0:
                        progressed = True
                        fill += k
                        if fill == want:
                            e0 = start // 4
                            m = want // 4
                            for i in range(m):
                                work[e0 + i] += bounce[i]
                            rdone += want; fill = 0
                    elif k == 0:
                        return -1
                else:
                    n = r_len[ri] * 4 - rdone
                    k = c_recv(lfd, base + r_off[ri] * 4 + rdone, n, DONTWAIT)
                    if k > 0:
                        progressed = True
                        rdone += k
                    elif k == 0:
                        return -1
                if rdone == r_len[ri] * 4 and fill == 0:
                    if kind != 3:
                        s_off[ns] = r_off[ri]; s_len[ns] = r_len[ri]; ns += 1
                    ri += 1; rdone = 0
        if si >= ns and ri >= nr:
            break
        # poll
        pfd[0, 0] = rfd; pfd[0, 1] = POLLOUT if si < ns else 0
        pfd[1, 0] = lfd; pfd[1, 1] = POLLIN if ri < nr else 0
        c_poll(pdata, 2, 10000)
    return 0

def main():
    rt = osu.BitcollRuntime()
    ref = osu.open_runtime("gloo")
    comm = rt.comm; tr = comm.transport
    p, r = comm.size, comm.rank
    left, right = (r - 1) % p, (r + 1) % p
    lfd = tr._peers[left].sock.fileno(); rfd = tr._peers[right].sock.fileno()
    import socket as _s
    buf = int(os.environ.get("BUF", 0))
    if buf:
        for q in set((left, right)):
            sk = tr._peers[q].sock
            sk.setsockopt(_s.SOL_SOCKET, _s.SO_SNDBUF, buf); sk.setsockopt(_s.SOL_SOCKET, _s.SO_RCVBUF, buf)
    if r == 0:
        sk = tr._peers[right].sock
        print("bufs", sk.getsockopt(_s.SOL_SOCKET, _s.SO_SNDBUF), sk.getsockopt(_s.SOL_SOCKET, _s.SO_RCVBUF), "seg", os.environ.get("SEG"), flush=True)
    sizes = [int(s) for s in sys.argv[1].split(",")] if len(sys.argv) > 1 else [64 << 20]
    seg = int(os.environ.get("SEG", 1 << 20)) // 4
    piece = int(os.environ.get("PIECE", 256 << 10)) // 4
    bounce = np.empty(piece, np.float32)
    pfd = np.zeros((2, 2), np.int32)
    rounds = int(os.environ.get("ROUNDS", 5)); it = int(os.environ.get("ITERS", 8))
    for nbytes in sizes:
        n = nbytes // 4
        rng = np.random.default_rng(r)
        x0 = rng.integers(-8, 8, n).astype(np.float32)
        bounds = np.array([(n * i) // p for i in range(p + 1)], np.int64)
        # check
        w = x0.copy()
        rc = ring(w, bounds, r, p, seg, lfd, rfd, bounce, pfd)
        print('rank', r, 'rc', rc, flush=True)
        exp = sum(np.random.default_rng(q).integers(-8, 8, n).astype(np.float32) for q in range(p))
        assert np.array_equal(w, exp), "mismatch"
        y = np.zeros(n, np.float32)
        gop, _ = osu_allreduce.make_op(ref, y, y.copy(), True, "auto")
        bop, _ = osu_allreduce.make_op(rt, np.zeros(n, np.float32), np.zeros(n, np.float32), True, "auto")
        nat = lambda: ring(w, bounds, r, p, seg, lfd, rfd, bounce, pfd)
        res = {"native": [], "gloo": [], "bitcoll": []}
        ops = [("native", nat), ("gloo", gop), ("bitcoll", bop)]
        for k in range(rounds):
            for name, op in (ops if k % 2 == 0 else ops[::-1]):
                ref.barrier(); op(); ref.barrier()
                t = time.perf_counter(); c = time.process_time()
                for _ in range(it):
                    op()
                ref.barrier()
                res[name].append(((time.perf_counter() - t) / it * 1e3, (time.process_time() - c) / it * 1e3))
        if r == 0:
            for name, v in res.items():
                a = np.array(v)
                print(f"{nbytes:>10} {name:8s} best {a[:,0].min():8.2f} ms median {np.median(a[:,0]):8.2f} ms cpu {np.median(a[:,1]):7.2f} ms", flush=True)
    ref.close(); rt.close()

main()
