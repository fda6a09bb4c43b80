"""Files only the server's own user may read: a directory 0700, every file in it 0600.

The durable cache manager's state dir (`--state-dir`) holds tenants' token ids (the journal's
Steps, snapshot.bin's trees). Modes are set explicitly (fchmod / chmod after creating), so neither
a permissive umask (022 makes a plain `open()` 0644) nor a file or directory left with looser
modes by an older version or an operator's copy keeps the data readable by other users.
"""

from __future__ import annotations

import os
import stat
from collections.abc import Callable

DIR_MODE = 0o700
FILE_MODE = 0o600


def make_private_dir(path: str, owns: Callable[[str], bool] | None = None) -> None:
    """Create `path` (and missing parents) if needed, then force it to 0700 and every regular file
    directly in it to 0600.

    `owns(name)`: which entries are the caller's. Given, a directory holding anything else (but a
    file system's `lost+found`) is refused untouched: a mistyped path must not make, say, a shared
    directory private. Raises OSError (also PermissionError when another user owns it,
    NotADirectoryError) so the caller can refuse to start."""
    os.makedirs(path, mode=DIR_MODE, exist_ok=True)
    names = os.listdir(path)
    if owns is not None:
        others = sorted(n for n in names if not owns(n) and n != "lost+found")
        if others:
            raise OSError(f"{path} holds {', '.join(others[:5])}{' ...' if len(others) > 5 else ''}, which are "
                          "not this server's: give it a directory of its own")
    os.chmod(path, DIR_MODE)  # (a symlink given as the directory: its target, the real directory)
    with os.scandir(path) as entries:
        for entry in entries:
            if not entry.is_file(follow_symlinks=False) or (owns is not None and not owns(entry.name)):
                continue
            if stat.S_IMODE(entry.stat(follow_symlinks=False).st_mode) != FILE_MODE:
                os.chmod(entry.path, FILE_MODE)


def open_private(path: str, flags: int) -> int:
    """os.open(path, flags | O_CREAT) as a 0600 file whatever the umask, also when it existed with
    other modes; never follows a symlink at `path`. Returns the descriptor (close-on-exec)."""
    fd = os.open(path, flags | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, FILE_MODE)
    try:
        os.fchmod(fd, FILE_MODE)
    except BaseException:
        os.close(fd)
        raise
    return fd
