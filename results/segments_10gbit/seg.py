"""python seg.py BYTES script args...: run script with bitcoll.init's default segment size set."""
import functools, os, runpy, sys
import bitcoll, bitcoll.bootstrap as bs
seg = int(sys.argv[1])
orig = bs.init
bitcoll.init = bs.init = functools.partial(orig, segment_bytes=seg)
sys.argv = sys.argv[2:]
sys.path.insert(0, os.path.dirname(os.path.abspath(sys.argv[0])))
runpy.run_path(sys.argv[0], run_name="__main__")
