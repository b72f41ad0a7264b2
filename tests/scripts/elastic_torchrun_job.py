"""An elastic job for torchrun ``--max-restarts N`` (tests/test_elastic_torchrun.py).

The loop of ``elastic_job.py`` (:func:`elastic_job.run_job`) on torchrun's agent store: the
first incarnation (``TORCHELASTIC_RESTART_COUNT`` 0) of the rank named by ``ELASTIC_VICTIM``
SIGKILLs itself at step 3. Rank 0 of each epoch writes the state and its step to
``ELASTIC_CHECKPOINT`` (a file, replaced atomically) after every committed step; a rank of a
new generation's epoch 0 (every process of the job was restarted: nobody holds the state any
more) resumes from it, a joiner of a running job receives the state from the holders. The
job ends once ``STEPS`` steps are committed with the full world; every rank prints its
generation, world size, committed steps and the state's checksum."""

from __future__ import annotations

import os
import zlib

from elastic_job import join, run_job


def main() -> None:
    joined = join("TORCHELASTIC_RESTART_COUNT")
    if joined is None:
        return
    group, victim = joined
    w, committed, resumed = run_job(group, victim, os.environ["ELASTIC_CHECKPOINT"])
    group.finish()
    line = (f"rank {group.epoch.rank} restart={os.environ.get('TORCHELASTIC_RESTART_COUNT')} "
            f"generation={group.generation} epoch={group.epoch.number} resumed={resumed} "
            f"size={group.epoch.size} steps={committed + 1} crc={zlib.crc32(w.tobytes())}\n")
    os.write(1, line.encode())  # one write: the workers share torchrun's stdout
    group.close()


if __name__ == "__main__":
    main()
