"""Spill folders and checkpoint temp files: one validator, owner locks, and the next run removing
what a killed run left behind (but never what a live run still uses)."""
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

from memfit.core import spill
from memfit.core.checkpoint_temps import remove_stale_checkpoint_temps, temp_prefix
from memfit.core.errors import ConfigError
from memfit.core.spill import SpillFolder, remove_stale_spill_folders, validate_spill_dir

SRC = str(Path(__file__).resolve().parents[1] / "src")


def python(code: str, **kw) -> subprocess.Popen:
    env = dict(os.environ, PYTHONPATH=SRC + os.pathsep + os.environ.get("PYTHONPATH", ""))
    return subprocess.Popen([sys.executable, "-c", code], env=env, stdout=subprocess.PIPE,
                            stdin=subprocess.PIPE, text=True, **kw)


def killed_owner(root: Path, kind: str = "optim") -> Path:
    """A spill folder (with a file in it) whose owner process was killed with SIGKILL."""
    p = python(f"""
import os, signal
from memfit.core.spill import SpillFolder
f = SpillFolder({str(root)!r}, {kind!r})
open(f.file("state_0.bin"), "wb").write(b"x" * 4096)
print(f.path, flush=True)
os.kill(os.getpid(), signal.SIGKILL)
""")
    folder = Path(p.stdout.readline().strip())
    assert p.wait(timeout=60) == -signal.SIGKILL
    return folder


def dead_pid() -> int:
    p = subprocess.Popen([sys.executable, "-c", "pass"])
    p.wait()
    return p.pid


def test_validator_creates_a_missing_root_and_refuses_files_and_full_disks(tmp_path, monkeypatch):
    assert validate_spill_dir(tmp_path / "a" / "b") == tmp_path / "a" / "b" and (tmp_path / "a" / "b").is_dir()
    (tmp_path / "f").write_text("x")
    with pytest.raises(ConfigError, match=r"'.*f' is a file, not a folder; pass spill_dir \(--spill-dir\)"):
        validate_spill_dir(tmp_path / "f")
    with pytest.raises(ConfigError, match="cannot be created"):
        validate_spill_dir(tmp_path / "f" / "sub")
    monkeypatch.setattr(spill.shutil, "disk_usage", lambda p: type("U", (), {"free": 300 * 2**20})())
    validate_spill_dir(tmp_path)  # above the 256 MiB floor
    with pytest.raises(ConfigError, match="has only 300.00 MiB free; optimizer offload needs at least 1.00 GiB"):
        validate_spill_dir(tmp_path, need_bytes=2**30, purpose="optimizer offload")


def test_spill_folder_names_its_owner_and_holds_a_lock(tmp_path):
    f = SpillFolder(tmp_path, "act")
    assert f.path.parent == tmp_path and spill.owner_pid(f.path.name) == os.getpid()
    assert f.path.name.startswith(f"memfit-spill-{os.getpid()}-act-")
    assert (f.path / spill.LOCK_NAME).exists()
    assert remove_stale_spill_folders(tmp_path) == [] and f.path.exists()  # our own live folder stays
    f.close()
    f.close()
    assert not f.path.exists() and f.closed


def test_folder_of_a_killed_process_is_removed_by_the_next_run(tmp_path):
    stale = killed_owner(tmp_path)
    assert stale.is_dir() and (stale / "state_0.bin").exists()  # kill -9: nothing cleaned up
    unrelated = tmp_path / "memfit-spill-notes"
    unrelated.mkdir()
    f = SpillFolder(tmp_path, "optim")  # the next run using this spill root
    assert not stale.exists()
    assert unrelated.exists() and f.path.exists()
    f.close()


def test_folder_of_a_live_process_is_kept(tmp_path):
    p = python(f"""
import sys
from memfit.core.spill import SpillFolder
f = SpillFolder({str(tmp_path)!r}, "act")
print(f.path, flush=True)
sys.stdin.readline()
f.close()
""")
    live = Path(p.stdout.readline().strip())
    try:
        assert remove_stale_spill_folders(tmp_path) == []
        SpillFolder(tmp_path, "optim").close()
        assert live.is_dir()
    finally:
        p.stdin.write("\n")
        p.stdin.flush()
        assert p.wait(timeout=60) == 0
    assert not live.exists()  # its owner removed it on close


def test_lock_free_folders_go_by_process_id(tmp_path):
    """Folders without a lock file (older memfit): removed when the pid in the name is dead, kept
    while it lives (this process) or when the name carries no pid."""
    dead = tmp_path / f"memfit-spill-{dead_pid()}-abcd1234"
    ours = tmp_path / f"memfit-spill-{os.getpid()}-efgh5678"
    nameless = tmp_path / "memfit-spill-k2j3h4g5"
    for d in (dead, ours, nameless):
        d.mkdir()
        (d / "00000001.bin").write_bytes(b"x")
    assert remove_stale_spill_folders(tmp_path) == [dead]
    assert ours.exists() and nameless.exists()


def fake_stale(root: Path, kind: str) -> Path:
    """What kill -9 leaves: a folder named for a dead pid, its lock file no longer held."""
    d = root / f"memfit-spill-{dead_pid()}-{kind}-x1y2z3w4"
    d.mkdir(parents=True)
    (d / spill.LOCK_NAME).write_bytes(b"")
    (d / "state_0.bin").write_bytes(b"x" * 4096)
    return d


def test_both_offloads_remove_stale_folders_when_they_open_theirs(tmp_path):
    import torch

    import memfit
    from memfit.apply.checkpoint import applied, remove
    from memfit.apply.optimizer import TrainingOptimizer
    from memfit.models.gpt import GPT, GPTConfig

    stale = fake_stale(tmp_path / "o", "act")
    with TrainingOptimizer(torch.nn.Linear(4, 4), offload="disk", spill_dir=str(tmp_path / "o")) as opt:
        assert list((tmp_path / "o").iterdir()) == [Path(opt.streamed.folder)] and not stale.exists()
        assert Path(opt.streamed.folder).name.startswith(f"memfit-spill-{os.getpid()}-optim-")
    stale = fake_stale(tmp_path / "a", "optim")
    model = GPT(GPTConfig(layers=2, hidden=32, heads=2, vocab=64, seq=16))
    memfit.checkpoint(model, "full+offload:disk", spill_dir=str(tmp_path / "a"))
    x = torch.randint(0, 64, (2, 16))
    model(x, x)[1].backward()
    folder = applied(model).store.spill_folder
    assert list((tmp_path / "a").iterdir()) == [folder] and not stale.exists()
    assert folder.name.startswith(f"memfit-spill-{os.getpid()}-act-")
    remove(model)
    assert list((tmp_path / "a").iterdir()) == []


@pytest.mark.slow
def test_optimizer_and_activation_offload_clean_up_after_a_killed_run(tmp_path):
    """The real users: a run offloading both activations and the optimizer to disk is killed with
    SIGKILL mid-training; the next optimizer or activation offload on that root removes both folders."""
    p = python(f"""
import os, signal, torch
import memfit
from memfit.apply.optimizer import TrainingOptimizer
from memfit.models.gpt import GPT, GPTConfig
model = GPT(GPTConfig(layers=2, hidden=32, heads=2, vocab=64, seq=16))
memfit.checkpoint(model, "full+offload:disk", spill_dir={str(tmp_path)!r})
opt = TrainingOptimizer(model, "adamw", offload="disk", spill_dir={str(tmp_path)!r})
x = torch.randint(0, 64, (2, 16))
_, loss, n = model(x, x)
print("forward done", flush=True)
os.kill(os.getpid(), signal.SIGKILL)
""")
    assert p.stdout.readline().strip() == "forward done"
    assert p.wait(timeout=120) == -signal.SIGKILL
    left = sorted(d.name.split("-")[3] for d in tmp_path.iterdir())
    assert left == ["act", "optim"]
    import torch

    from memfit.apply.optimizer import TrainingOptimizer

    with TrainingOptimizer(torch.nn.Linear(4, 4), offload="disk", spill_dir=str(tmp_path)) as opt:
        assert [d for d in tmp_path.iterdir()] == [Path(opt.streamed.folder)]
    assert list(tmp_path.iterdir()) == []


def test_stale_checkpoint_temp_files_are_removed(tmp_path):
    target = tmp_path / "checkpoint.pt"
    target.write_bytes(b"the last good checkpoint")
    p = python(f"""
import os, signal, tempfile
from memfit.core.checkpoint_temps import temp_prefix
fd, tmp = tempfile.mkstemp(prefix=temp_prefix({str(target)!r}), suffix=".tmp", dir={str(tmp_path)!r})
os.write(fd, b"half a checkpoint")
print(tmp, flush=True)
os.kill(os.getpid(), signal.SIGKILL)
""")
    killed = Path(p.stdout.readline().strip())
    assert p.wait(timeout=60) == -signal.SIGKILL and killed.exists()
    live = python("import sys; sys.stdin.readline()")
    try:
        alive = tmp_path / f".checkpoint.pt.{live.pid}.abcd1234.tmp"
        ours = Path(tempfile.mkstemp(prefix=temp_prefix(target), suffix=".tmp", dir=tmp_path)[1])
        young_legacy = tmp_path / ".checkpoint.pt.abcdefgh.tmp"
        old_legacy = tmp_path / ".checkpoint.pt.ijklmnop.tmp"
        other = tmp_path / ".notes.txt.1.tmp"
        for f in (alive, young_legacy, old_legacy, other):
            f.write_bytes(b"x")
        two_hours_ago = time.time() - 7200
        os.utime(old_legacy, (two_hours_ago, two_hours_ago))
        removed = remove_stale_checkpoint_temps(tmp_path)
        assert sorted(removed) == sorted([killed, ours, old_legacy])
        assert alive.exists() and young_legacy.exists() and other.exists()
        assert target.read_bytes() == b"the last good checkpoint"
    finally:
        live.stdin.write("\n")
        live.stdin.flush()
        live.wait(timeout=60)


def test_a_reused_pid_does_not_protect_a_dead_owners_folder(tmp_path):
    """A folder named with this very pid but not opened by this process (a killed earlier process
    had the same pid, as in a restarted container) is stale once its lock can be taken."""
    leftover = tmp_path / f"memfit-spill-{os.getpid()}-optim-a1b2c3d4"
    leftover.mkdir()
    (leftover / spill.LOCK_NAME).write_bytes(b"")
    live = SpillFolder(tmp_path, "optim")
    assert not leftover.exists() and live.path.exists()
    assert remove_stale_spill_folders(tmp_path) == []
    live.close()
