"""Run a bitcoll program with shared memory but without single-copy records (the ring only):
``python -m launch -n 2 results/shm/ring_only.py bench/osu_allreduce.py ARGS...``.
An ablation for results/shm/; not a user setting."""
import os
import runpy
import sys

import bitcoll.transport.shm as shm

shm.SINGLE_COPY = False
sys.argv = sys.argv[1:]
sys.path.insert(0, os.path.dirname(os.path.abspath(sys.argv[0])))
runpy.run_path(sys.argv[0], run_name="__main__")
