"""Run a bitcoll program with the shared-memory single-copy threshold (SC=bytes) and the
receiver-thread threshold (HR=bytes) set from the environment: an ablation for
results/shm_small, not a user setting.
``SC=2097152 python -m launch -n 2 results/shm_small/tune.py bench/osu_allreduce.py ARGS``."""
import os
import runpy
import sys

import bitcoll.transport.hybrid as hybrid
import bitcoll.transport.shm as shm

if "SC" in os.environ:
    shm.SINGLE_COPY_MIN_BYTES = int(os.environ["SC"])  # type: ignore[misc]
if "HR" in os.environ:
    hybrid.HELPER_RECEIVE_BYTES = int(os.environ["HR"])  # type: ignore[misc]
sys.argv = sys.argv[1:]
sys.path.insert(0, os.path.dirname(os.path.abspath(sys.argv[0])))
runpy.run_path(sys.argv[0], run_name="__main__")
