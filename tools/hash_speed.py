"""Hash and checksum CPU per GiB on this machine (decision 0025): sha256, BLAKE3,
MD5, CRC32, CRC32C over 8 MiB buffers, per-thread CPU time (wall time on a shared VM
swings with other load)."""
import hashlib, time, zlib, os, statistics
from blake3 import blake3
import crc32c
data = os.urandom(8 << 20)
N = 32  # 256 MiB per sample
def run(f):
    ts=[]
    for _ in range(5):
        t=time.thread_time()
        for _ in range(N): f(data)
        ts.append((time.thread_time()-t)/(N*8/1024))
    return statistics.median(ts)
for name, f in [("sha256", lambda d: hashlib.sha256(d).digest()),
                ("blake3 (1 thread)", lambda d: blake3(d).digest()),
                ("blake3 max_threads=2 (CPU of calling thread only!)", lambda d: blake3(d, max_threads=2).digest()),
                ("md5 (Content-MD5)", lambda d: hashlib.md5(d).digest()),
                ("crc32 (zlib)", lambda d: zlib.crc32(d)),
                ("crc32c (crc32c pkg, hw)", lambda d: crc32c.crc32c(d)),
                ("blake3 + crc32c", lambda d: (blake3(d).digest(), crc32c.crc32c(d)))]:
    print(f"{name:<52} {run(f):.3f} CPU s/GiB")
# wall for max_threads
def wall(f):
    ts=[]
    for _ in range(5):
        t=time.perf_counter()
        for _ in range(N): f(data)
        ts.append((time.perf_counter()-t)/(N*8/1024))
    return statistics.median(ts)
print("wall: blake3 1t %.3f, blake3 2t %.3f, sha256 %.3f s/GiB" % (wall(lambda d: blake3(d).digest()), wall(lambda d: blake3(d, max_threads=2).digest()), wall(lambda d: hashlib.sha256(d).digest())))
