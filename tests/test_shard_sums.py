"""A flipped byte in one rank's shard of a sharded (DCP) checkpoint is refused on every rank, naming
the entry (memfit.distributed.shard_sums; docs/reliability.md, "Checksums")."""
from __future__ import annotations

from pathlib import Path

import pytest
import torch

from memfit.distributed.spawn import run_world
from memfit.models.gpt import GPT, GPTConfig

pytestmark = [pytest.mark.multiproc]

CFG = dict(layers=2, hidden=16, heads=2, vocab=32, seq=8)


def _flip_in(folder: Path, name: str) -> str:
    """Flip one byte inside the stored bytes of the first item of entry `name`; returns its file."""
    import torch.distributed.checkpoint as dcp

    storage = dcp.FileSystemReader(str(folder)).read_metadata().storage_data
    index, info = next((i, s) for i, s in storage.items() if i.fqn == name)
    path = folder / info.relative_path
    data = bytearray(path.read_bytes())
    data[info.offset + info.length // 2] ^= 0x01
    path.write_bytes(bytes(data))
    return info.relative_path


def _work(rank, world, path):
    import torch.distributed as dist

    from memfit.core.errors import ConfigError
    from memfit.distributed import distribute, shard_sums
    from memfit.distributed.checkpoint import save_sharded

    folder = Path(path)
    torch.manual_seed(0)
    with distribute(GPT(GPTConfig(**CFG)), "zero2", "adamw", engine="memfit", lr=1e-2) as opt:
        x = torch.randint(0, CFG["vocab"], (2, CFG["seq"] + 1))
        _, loss, _ = opt.model(x[:, :-1].contiguous(), x[:, 1:].contiguous())
        opt.backward(loss)
        opt.step()
        save_sharded(opt, folder)
    sums = shard_sums.gather(folder)
    shard_sums.check(folder, sums)  # as saved: passes on every rank
    dist.barrier()
    if rank == world - 1:
        _flip_in(folder, "bucket1.exp_avg_sq")
    dist.barrier()
    try:
        shard_sums.check(folder, sums)
    except ConfigError as exc:
        return sums, str(exc)
    return sums, None


def test_a_flipped_byte_in_a_shard_is_refused_on_every_rank_naming_the_entry(tmp_path):
    from memfit.core.errors import ConfigError
    from memfit.distributed import shard_sums

    folder = tmp_path / "sharded-1"
    results = run_world(_work, 2, (str(folder),))
    (sums0, err0), (sums1, err1) = results
    assert sums0 == sums1 and sums0["folder"] == "sharded-1"
    assert any(k.startswith("bucket1.exp_avg_sq") for k in sums0["crc32"])
    # Every rank refuses, the one that did not read the damaged file too, with the same line.
    assert err0 == err1 and "is corrupt: entry bucket1.exp_avg_sq" in err0
    # One process reading the whole folder (a resume into another layout, memfit export) refuses it too.
    with pytest.raises(ConfigError, match="entry bucket1.exp_avg_sq .*does not match"):
        shard_sums.check(folder, sums0, alone=True)
    # A damaged .metadata is named as such.
    meta = folder / shard_sums.METADATA
    meta.write_bytes(meta.read_bytes()[:-1] + bytes([meta.read_bytes()[-1] ^ 1]))
    with pytest.raises(ConfigError, match=r"\.metadata file does not match"):
        shard_sums.check(folder, sums0, alone=True)
