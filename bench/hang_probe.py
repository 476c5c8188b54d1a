"""Run a Python script with a hang alarm: after SECONDS, print every thread's Python stack and exit.

    torchrun --nproc-per-node=2 bench/hang_probe.py 40 bench/baselines/graph_step.py

Used to find where bench/baselines/graph_step.py (NCCL all_reduce inside a captured step) hangs: its last
stack names the line (capture, replay, barrier or destroy_process_group).
"""

import faulthandler
import runpy
import sys

seconds, script = float(sys.argv[1]), sys.argv[2]
sys.argv = sys.argv[2:]
faulthandler.dump_traceback_later(seconds, exit=True)
print(f"[hang_probe] {script}: if still running after {seconds:g} s, every thread's stack follows", flush=True)
runpy.run_path(script, run_name="__main__")
print(f"[hang_probe] {script} returned", flush=True)
