"""Count the samples of `perf script` whose leaf is one of LEAFS by the DEPTH frames above it.
Run: python3 kernel_profile_stacks.py PERF.DATA LEAF[,LEAF...] DEPTH [ROWS]"""
import sys, collections, subprocess
data = sys.argv[1]; leafs = sys.argv[2].split(","); depth = int(sys.argv[3])
out = subprocess.run(["perf", "script", "-i", data, "-F", "comm,tid,ip,sym"], capture_output=True, text=True).stdout
c = collections.Counter(); total = 0
for block in out.split("\n\n"):
    lines = [l.strip() for l in block.strip().splitlines()]
    if len(lines) < 2: continue
    frames = [l.split(None, 1)[1] if " " in l else l for l in lines[1:]]
    total += 1
    if frames[0] in leafs:
        c[(lines[0].split()[0],) + tuple(frames[1:1 + depth])] += 1
print("total", total)
for k, v in c.most_common(int(sys.argv[4]) if len(sys.argv) > 4 else 15):
    print(v, " <- ".join(k))
