"""Consecutive 2-process torchrun runs of short training scripts that end with a plain
return: every one must exit 0 (the clean exit of docs/runtime.md).

    python bench/runtime/exit_loop.py --runs 50                      # dp, pp, bert in turn
    python bench/runtime/exit_loop.py --runs 30 --without-teardown   # the same, no exit hook

Each run is ``torchrun --nproc-per-node 2 bench/runtime/exit_job.py CASE GEN_DIR --end
END`` on CPU with gloo (generated files reused after each case's first run); the cases
take turns, and so do the two endings (``destroy``: ``destroy_process_group()`` then
return; ``return``: return at once), so 6 runs cover every pair. Prints one line per run
(case, exit code, seconds) and the count; a failed run shows the tail of its output. Exits
1 if any run failed. Not a unit test: 50 runs take minutes.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from nnscaler.testing import free_port

JOB = Path(__file__).with_name("exit_job.py")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--runs", type=int, default=50)
    parser.add_argument("--cases", default="dp,pp,bert", help="comma-separated, run in turn")
    parser.add_argument("--without-teardown", action="store_true",
                        help="unregister nnscaler's exit hook in the job (for comparison)")
    args = parser.parse_args()
    cases = args.cases.split(",")
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1",
           "NNSCALER_DEVICE": "cpu"}
    failures = []
    start = time.perf_counter()
    with tempfile.TemporaryDirectory() as gen:
        for i in range(args.runs):
            case = cases[i % len(cases)]
            end = ("destroy", "return")[i % 2]
            cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
                   "--master-addr", "127.0.0.1", "--master-port", str(free_port()),
                   str(JOB), case, gen, "--end", end]
            if args.without_teardown:
                cmd.append("--without-teardown")
            t0 = time.perf_counter()
            proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=600)
            took = time.perf_counter() - t0
            print(f"run {i + 1:3d} {case:5s} {end:8s} exit {proc.returncode}  {took:5.1f} s",
                  flush=True)
            if proc.returncode != 0:
                tail = [ln for ln in (proc.stdout + proc.stderr).splitlines()
                        if "terminate" in ln or "Error" in ln or "exitcode" in ln]
                print("    " + "\n    ".join(tail[-6:]), flush=True)
                failures.append((i + 1, f"{case}, {end}", proc.returncode))
    total = time.perf_counter() - start
    ok = args.runs - len(failures)
    hook = "without the exit hook" if args.without_teardown else "with nnscaler's exit hook"
    print(f"{ok} of {args.runs} runs exited 0 ({hook}; cases {', '.join(cases)}; "
          f"{total:.0f} s, {total / args.runs:.1f} s per run)")
    if failures:
        print("failed: " + ", ".join(f"run {n} ({c}, exit {rc})" for n, c, rc in failures))
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
