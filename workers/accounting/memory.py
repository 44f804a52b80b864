"""Free memory of a worker's device, read one way everywhere (batch sizing, the memory schedule, scoring batches).

On CUDA: the driver's free memory plus what torch's caching allocator holds unused. On CPU: the host's
MemAvailable (/proc/meminfo), else sysconf's available pages.
"""

from __future__ import annotations

import os

import torch

def host_available_bytes() -> int | None:
    """Memory the host can still give (MemAvailable of /proc/meminfo, else sysconf's available pages), or None."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024  # the value is in kB
    except (OSError, ValueError, IndexError):
        pass
    try:
        return int(os.sysconf("SC_AVPHYS_PAGES")) * int(os.sysconf("SC_PAGE_SIZE"))
    except (AttributeError, OSError, ValueError):
        return None


def device_free_bytes(device: torch.device) -> int | None:
    """Free memory of the device (None where the host's cannot be read)."""
    if device.type == "cuda":
        cached = torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device)
        return int(torch.cuda.mem_get_info(device)[0]) + int(cached)
    return host_available_bytes()


def free_memory_bytes(device: torch.device) -> int:
    """Free memory of the device; raises where it cannot be read."""
    free = device_free_bytes(device)
    if free is None:
        raise RuntimeError("cannot read the host's available memory (/proc/meminfo, sysconf) to size a batch")
    return free


def share_bytes(device: torch.device, share: float) -> int | None:
    """What an actor that holds `share` of a GPU (resources.gpus_per_worker below 1: several actors packed on one
    device) may still take of it: its share of the device's total memory less what this process holds already (its
    models), never more than is free. None off a GPU or for a whole device (its free memory is the bound)."""
    if device.type != "cuda" or not 0 < share < 1:
        return None
    total = int(torch.cuda.get_device_properties(device).total_memory)
    return min(int(share * total) - int(torch.cuda.memory_reserved(device)), device_free_bytes(device))
