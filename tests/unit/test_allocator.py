"""The allocator setting the sampler actors apply: freed batch memory stays in the process."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from raylane.actors.allocator import MMAP_THRESHOLD_MAX, keep_freed_memory

pytestmark = [pytest.mark.unit, pytest.mark.timeout(120)]

# A batch-shaped allocation pattern: a 6 MiB feature array and 16 MiB of smaller
# temporaries, all freed at the end of the call. glibc's adaptive thresholds settle at
# mmap 6 MiB / trim 12 MiB after the first free, so the 16 MiB of freed heap top is handed
# back to the kernel each time and faulted in again on the next call. Prints the page
# faults of the last 30 of 40 calls.
PROBE = """
import resource, sys
import numpy as np
from raylane.actors.allocator import keep_freed_memory
if sys.argv[1] == "keep":
    assert keep_freed_memory()
for i in range(40):
    if i == 10:
        f0 = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    big = np.ones(6 * 2**20 // 8)
    parts = [np.ones(4 * 2**20 // 8) for _ in range(4)]
    del big, parts
print(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - f0)
"""


def faults(mode: str) -> int:
    out = subprocess.run([sys.executable, "-c", PROBE, mode], capture_output=True, text=True, timeout=60, check=True)
    return int(out.stdout.strip())


def glibc() -> bool:
    try:
        return os.confstr("CS_GNU_LIBC_VERSION").startswith("glibc")
    except (ValueError, OSError, AttributeError):
        return False


@pytest.mark.skipif(not glibc(), reason="mallopt is glibc's")
def test_kept_memory_spares_the_page_faults_of_every_new_batch():
    default, kept = faults("default"), faults("keep")
    # Trimmed on every call, the 16 MiB cost ~4,000 faults (4 KiB pages) each time; kept,
    # the pages are reused.
    assert default > 30 * 1000, default
    assert kept < 30 * 50, kept


def test_thresholds_out_of_range_are_refused():
    with pytest.raises(ValueError, match="mmap_threshold=0"):
        keep_freed_memory(mmap_threshold=0)
    with pytest.raises(ValueError, match=str(MMAP_THRESHOLD_MAX)):
        keep_freed_memory(mmap_threshold=MMAP_THRESHOLD_MAX + 1)
    with pytest.raises(ValueError, match="trim_threshold=1024"):
        keep_freed_memory(mmap_threshold=2048, trim_threshold=1024)
