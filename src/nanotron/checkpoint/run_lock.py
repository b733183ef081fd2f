"""One training run at a time in a run folder (``checkpoints.checkpoints_path``).

Two runs started on one folder would resume from each other's checkpoints, prune each other's saves and rewrite each
other's metrics. A run therefore holds ``run.lock`` in its folder from before anything there is read (the resume
choice, the metrics file) until it exits, and a second run is refused with one line naming the owner and the fix.

Who holds it: the lowest rank of the ranks that see the folder. On a file system every node sees, that is global
rank 0, and one lock covers every node (a lock per node would take the other nodes' locks of the same run for another
run's). With ``checkpoints_path_is_shared_file_system: false`` each node may have a folder of its own
(``node_folders.py``): each such folder has its own lock, held by its node's lowest rank.

How: a file created with ``O_CREAT | O_EXCL`` that holds JSON ``{host, pid, started}``. ``flock``/``fcntl`` locks
would vanish by themselves with a killed owner, but they live in the kernel of the node that takes them: on NFS they
need a lock manager that some mounts do without (``nolock``, then they lock only on one node), and Lustre ignores or
refuses them unless mounted with ``flock``; they would silently lock nothing exactly where runs share folders.
Exclusive creation is atomic on local disks, NFSv3+ and Lustre, and the file tells who holds the lock. The price is
that a run killed outright (kill -9, a crashed node) leaves the file behind: a lock of this host whose process is gone
is stale and taken over with a warning; a process on another host cannot be checked, so the error says how to delete
its lock by hand.

Released on every exit: ``Trainer.close`` (end of training, an error, a stop signal), and an ``atexit`` hook for a
process that ends without calling it.
"""

from __future__ import annotations

import atexit
import json
import logging
import os
import socket
import time
from datetime import datetime
from pathlib import Path

from nanotron.errors import CheckpointError

logger = logging.getLogger(__name__)

LOCK = "run.lock"
READ_ATTEMPTS = 20  # an owner that has just created the file may not have written its JSON yet
READ_PAUSE_S = 0.05


class RunLock:
    """The lock of one run folder, held by this process until ``release``."""

    def __init__(self, path: Path, text: str):
        self.path, self.text = path, text
        atexit.register(self.release)

    @classmethod
    def take(cls, root: Path) -> RunLock:
        """Lock ``root`` (created if missing) for this process, or raise CheckpointError naming the run holding it."""
        try:
            root.mkdir(parents=True, exist_ok=True)
        except OSError as error:
            raise not_writable(root, error) from error
        path = root / LOCK
        text = json.dumps({"host": socket.gethostname(), "pid": os.getpid(),
                           "started": datetime.now().astimezone().isoformat(timespec="seconds")})
        while True:  # ends with the lock taken or an error; a stale lock removed is looked at again
            try:
                fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
            except FileExistsError:
                held = _read_lock(path)
                if held is not None:
                    _remove_if_stale(root, path, held)
                continue
            except OSError as error:
                raise not_writable(root, error) from error
            try:
                os.write(fd, text.encode())
                os.fsync(fd)
            finally:
                os.close(fd)
            return cls(path, text)

    def release(self) -> None:
        """Delete the lock if it is still this process's (idempotent)."""
        atexit.unregister(self.release)
        try:
            if self.path.read_text() == self.text:
                self.path.unlink()
        except FileNotFoundError:
            pass


def not_writable(root: Path, error: OSError) -> CheckpointError:
    return CheckpointError(f"checkpoints.checkpoints_path {root} is not writable ({error.strerror}); choose a folder "
                           "this user can write to")


def _read_lock(path: Path) -> str | None:
    """The lock file's text once its owner has written it (None if it disappeared meanwhile)."""
    for _ in range(READ_ATTEMPTS):
        try:
            text = path.read_text()
        except FileNotFoundError:
            return None
        if _owner(text) is not None:
            break
        time.sleep(READ_PAUSE_S)
    return text


def _owner(text: str) -> dict | None:
    try:
        owner = json.loads(text)
    except ValueError:
        return None
    valid = isinstance(owner, dict) and isinstance(owner.get("host"), str) and isinstance(owner.get("pid"), int)
    return owner if valid else None


def _is_running(pid: int) -> bool:
    """Whether process ``pid`` of this host is alive (a zombie, killed but not yet waited for, is not)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # it exists, under another user
        return True
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return True
    return state != "Z"


def _remove_if_stale(root: Path, path: Path, text: str) -> None:
    """Remove a lock whose owner died on this host; raise CheckpointError naming the owner of any other."""
    owner = _owner(text)
    if owner is None:
        raise CheckpointError(f"checkpoints.checkpoints_path {root} is locked by {path}, which names no owner "
                              f"({text[:60]!r}); if no run is using this folder, delete {path} by hand")
    host, pid, since = owner["host"], owner["pid"], owner.get("started", "an unknown time")
    held = (f"checkpoints.checkpoints_path {root} is in use by another training run (host {host}, pid {pid}, "
            f"since {since})")
    if host != socket.gethostname():
        raise CheckpointError(f"{held}, which cannot be checked from {socket.gethostname()}; wait for that run or "
                              f"train in another checkpoints_path, or if it has ended (killed, node lost), delete "
                              f"{path} by hand")
    # A lock of this very process is an earlier run of it that was not closed (a benchmark or a notebook building
    # trainers one after the other): this process cannot be two runs at once, so it takes the folder back.
    if _is_running(pid) and pid != os.getpid():
        raise CheckpointError(f"{held}; wait for it to end or stop it (kill {pid}), or train in another "
                              "checkpoints_path")
    # Set aside, then removed only if it is still the stale lock judged here: another starter may have replaced it
    # with its own in between (then it goes back, and the next look finds that run alive).
    aside = path.with_name(f"{LOCK}.stale-{socket.gethostname()}-{os.getpid()}")
    try:
        os.rename(path, aside)
    except FileNotFoundError:
        return
    if aside.read_text() != text:
        os.rename(aside, path)
        return
    aside.unlink()
    if pid != os.getpid():
        logger.warning(f"removed the lock of {root} left by pid {pid} (started {since}), which is no longer running")
