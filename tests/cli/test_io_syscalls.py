"""I/O system calls of a MoE torch_dist conversion (issue 37): every DCP item is a small
torch.save zip inside a rank file; ucp must read its end records, directory, local headers and
pickle, and write its framing (local headers, pickle, small records, directory), in a few large
preads/pwrites per item, not one per header field. `ucp convert` of a real megatron-core MoE save
(tests/tools/make_moe_torch_dist.py) runs under strace (-ff: one log per thread, no interleaved
lines); the counts are compared with the number of items of the source and of the output, read
from their .metadata by torch.distributed.checkpoint's own FileSystemReader (the oracle, not
ucp). Before issue 37 it took ~13 preads (9 of <= 256 bytes) and ~11 pwrites (8 small) per
item; the budget below is 4 of each, and almost no small pwrites.
"""
import os
import pathlib
import re
import shutil
import subprocess

from torch.distributed.checkpoint import FileSystemReader

import testmain  # noqa: E402
from testmain import UCP, Tmp  # noqa: E402

DATA = pathlib.Path(os.environ["UCP_TESTDATA"]) / "moe_torch_dist"
ITER = "iter_0000010"
# pread64(fd, buf, count, offset) = result
CALL = re.compile(r"^(pread64|pwrite64)\(\d+, .*, (\d+), \d+\) = (-?\d+)")
SMALL = 256


def items(ckpt):
    """The DCP items of a torch_dist save, from torch's reader of its .metadata."""
    return len(FileSystemReader(str(ckpt / ITER)).read_metadata().storage_data)


def traced(args, logs):
    """Runs ucp ARGS under strace; {syscall: [calls, calls of <= SMALL bytes, bytes]}."""
    subprocess.run(["strace", "-ff", "-qq", "-e", "trace=pread64,pwrite64", "-o",
                    str(logs / "st"), str(UCP), *map(str, args)], check=True,
                   capture_output=True)
    counts = {"pread64": [0, 0, 0], "pwrite64": [0, 0, 0]}
    for log in logs.glob("st.*"):
        for line in log.read_text(errors="replace").splitlines():
            m = CALL.match(line)
            if m:
                counts[m[1]][0] += 1
                counts[m[1]][1] += int(m[2]) <= SMALL
                counts[m[1]][2] += max(0, int(m[3]))
    return counts


def test_convert_reads_and_writes_each_item_in_a_few_syscalls():
    if shutil.which("strace") is None:
        print("strace is not installed: nothing measured")
        return
    src = DATA / "mixtral_tp1_pp2_dp2_ep2"
    with Tmp("ucp-io-") as t:
        logs = t / "logs"
        logs.mkdir()
        out = t / "out"
        c = traced(["convert", src, "-o", out, "--tp", 1, "--pp", 1, "--dp", 4, "--ep", 4,
                    "--distributed-optimizer", "--optimizer-sharding", "fully_reshardable",
                    "--no-sync", "-q"], logs)
        n_in, n_out = items(src), items(out)
        assert n_in >= 50 and n_out >= 50, (n_in, n_out)
        reads, small_reads, _ = c["pread64"]
        writes, small_writes, written = c["pwrite64"]
        print(f"{n_in} items read in {reads} preads ({small_reads} of <= {SMALL} bytes), "
              f"{n_out} written in {writes} pwrites ({small_writes} small)")
        # Every item is read and every byte of the output written (the trace saw the calls;
        # an archive's directory and the next one's headers are one pwrite, so a run of
        # items of small records may take fewer pwrites than items).
        size = sum(f.stat().st_size for f in (out / ITER).iterdir() if f.is_file())
        assert reads >= n_in and written >= size, (c, n_in, size)
        # (small reads remain: this save's tensors are tiny, their data reads too)
        assert reads <= 4 * n_in + 64, (c, n_in)
        assert writes <= 4 * n_out + 64 and small_writes <= n_out // 8 + 16, (c, n_out)


if __name__ == "__main__":
    testmain.run_tests(globals())
