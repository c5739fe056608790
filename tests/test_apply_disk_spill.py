"""The spill files of activation offload at the edges: a file cut short, and a read that must wait
for its own write (memfit.apply.disk_spill, memfit.apply.saved_copies.DiskCopy)."""
from __future__ import annotations

import os
import threading
import time

import pytest
import torch

from memfit.apply import disk_spill, saved_copies
from memfit.apply.offload import ActivationStore, SpillError


def test_a_truncated_spill_file_is_a_clear_error_not_short_data(tmp_path):
    """A spill file that lost its tail (a disk that filled, a file cut by another process) must not
    come back as a tensor whose last bytes are whatever the read buffer held."""
    spill = disk_spill.DiskSpill(tmp_path, disk_spill.OffloadStats())
    try:
        t = torch.arange(1024, dtype=torch.float32)
        path = spill.new_path()
        spill.write(path, [t], None)  # the write takes its tensor in a box (disk_spill.DiskSpill.write)
        os.truncate(path, t.numel() * 4 - 100)
        buf = torch.zeros(t.numel() * 4, dtype=torch.uint8)
        with pytest.raises(SpillError, match="is truncated"):
            spill.read(path, (t.shape, t.stride(), t.dtype), buf)
        assert not os.path.exists(path)  # removed all the same
    finally:
        spill.close()


def test_a_read_waits_for_its_write_to_finish(tmp_path, monkeypatch):
    """Backward can unpack a spilled tensor while its write is still running on a spill thread (a
    slow disk, the last block's tensors): the read waits for that write and gets every byte."""
    events = []
    unpacking = threading.Event()
    real_write, real_read, real_get = disk_spill.DiskSpill.write, disk_spill.DiskSpill.read, saved_copies.DiskCopy.get

    def slow_write(self, path, t, ready):
        unpacking.wait(10)  # the write is still running when backward asks for the tensor ...
        time.sleep(0.1)     # ... and takes a while longer: a read that did not wait finds no file
        real_write(self, path, t, ready)
        events.append("written")

    def logged_read(self, path, meta, buf):
        events.append("read")
        return real_read(self, path, meta, buf)

    def get(self):
        unpacking.set()
        return real_get(self)

    monkeypatch.setattr(disk_spill.DiskSpill, "write", slow_write)
    monkeypatch.setattr(disk_spill.DiskSpill, "read", logged_read)
    monkeypatch.setattr(saved_copies.DiskCopy, "get", get)
    store = ActivationStore(spill_dir=tmp_path)
    try:
        t = torch.randn(64, 32).exp()  # a computed tensor (not a leaf): it is offloaded
        out = store.unpack(store.pack(t, 0, "disk", None))
        assert events == ["written", "read"]
        assert torch.equal(out, t)
    finally:
        store.close()
