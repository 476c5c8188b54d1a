"""``launch.py`` with a checkpoint write held up, for a test that kills a run while a background save
is being written: ``python tests/runner/held_save_launch.py RECIPE [overrides]`` (under torchrun).

Each rank's first ``HELD_SAVE_AFTER`` saves are written as usual. In the next one the rank writes the
first record of its shard file, flushes it, creates the file ``<HELD_SAVE_MARK>-<rank>`` and writes
nothing more: the save stays in flight (uncommitted, its files partial) until the process is killed.
``HELD_SAVE_RANKS`` (comma-separated; every rank by default): the ranks whose write is held.
torch.distributed.checkpoint's file writer is patched here, in the test's process only.
"""

from __future__ import annotations

import os
import runpy
import sys
import threading

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, ROOT)

import torch.distributed.checkpoint.filesystem as filesystem  # noqa: E402

AFTER = int(os.environ["HELD_SAVE_AFTER"])
MARK = os.environ["HELD_SAVE_MARK"]
RANK = os.environ.get("RANK", "0")
HELD = RANK in os.environ.get("HELD_SAVE_RANKS", RANK).split(",")
saves = 0
write_data, write_item = filesystem._FileSystemWriter.write_data, filesystem._write_item


def counted_write_data(self, plan, planner):
    global saves
    saves += 1
    return write_data(self, plan, planner)


def held_write_item(transforms, stream, data, item, storage_key, serialization_format):
    result = write_item(transforms, stream, data, item, storage_key, serialization_format)
    if saves > AFTER and HELD:
        stream.flush()
        open(f"{MARK}-{RANK}", "w").close()
        threading.Event().wait()  # until the process is killed
    return result


filesystem._FileSystemWriter.write_data = counted_write_data
filesystem._write_item = held_write_item

sys.argv = [os.path.join(ROOT, "launch.py"), *sys.argv[1:]]
runpy.run_path(sys.argv[0], run_name="__main__")
