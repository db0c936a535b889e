"""Keys the app is given, kept off the command line: a command line is readable by every user of the machine
(`ps`, /proc/PID/cmdline), a file readable only by its owner is not, nor is the environment (/proc/PID/environ
is the owner's).

    key = read_key_file(Path("~/.config/infinigen/key"), "--api-key-file")   # KeyFileError saying why not
    print(exposed_key_warning("--api-key", "--api-key-file", "INFINIGEN_API_KEY"), file=sys.stderr)
"""

from __future__ import annotations

import os
import stat
import sys
from pathlib import Path

# A key is a line; a file far longer is not a key file (and /dev/zero or a log must not be read whole)
MOST_KEY_FILE_BYTES = 4096


class KeyFileError(ValueError):
    """Why a key file cannot be used, said for the command line."""


def read_key_file(path: Path, flag: str) -> str:
    """The key in `path`: its one line, surrounding whitespace (the final newline) removed. Warns on stderr
    where others than its owner may read it; refuses a missing, unreadable, empty, binary or long file."""
    shown = str(path)
    path = path.expanduser()
    try:  # opened without blocking, so a FIFO with no writer is refused below instead of hanging the start
        with os.fdopen(os.open(path, os.O_RDONLY | os.O_NONBLOCK), "rb") as file:
            mode = os.fstat(file.fileno()).st_mode
            if stat.S_ISDIR(mode):
                raise KeyFileError(f"{flag} {shown}: a directory, not a file")
            if not stat.S_ISREG(mode):
                raise KeyFileError(f"{flag} {shown}: not a regular file (a pipe or a device is not read); write "
                                   f"the key in a file, or set it in the environment")
            raw = file.read(MOST_KEY_FILE_BYTES + 1)
    except FileNotFoundError:
        raise KeyFileError(f"{flag} {shown}: no such file") from None
    except PermissionError:
        raise KeyFileError(f"{flag} {shown}: this user may not read it") from None
    except IsADirectoryError:
        raise KeyFileError(f"{flag} {shown}: a directory, not a file") from None
    except OSError as error:
        raise KeyFileError(f"{flag} {shown}: cannot read it ({error.strerror or error})") from None
    if len(raw) > MOST_KEY_FILE_BYTES:
        raise KeyFileError(f"{flag} {shown}: over {MOST_KEY_FILE_BYTES:,} bytes; a key file holds the key alone, "
                           f"on one line")
    try:
        key = raw.decode("utf-8-sig").strip()  # -sig: an editor's byte-order mark is not part of the key
    except UnicodeDecodeError:
        raise KeyFileError(f"{flag} {shown}: not UTF-8 text; a key file holds the key alone, on one line") from None
    if not key:
        raise KeyFileError(f"{flag} {shown}: the file is empty; write the key in it, on one line")
    if "\n" in key or "\r" in key:
        raise KeyFileError(f"{flag} {shown}: more than one line; a key file holds the key alone, on one line")
    if any(ord(character) < 32 or ord(character) == 127 for character in key):
        raise KeyFileError(f"{flag} {shown}: holds control characters (a binary file?); a key file holds the key "
                           f"alone, on one line")
    readers = _other_readers(mode)
    if readers:
        print(f"warning: {flag} {shown} can be read by {readers}, who can then use the key; "
              f"make it yours alone: chmod 600 {shown}", file=sys.stderr)
    return key


def _other_readers(mode: int) -> str:
    """Who besides the owner may read a file of this mode ('' for nobody)."""
    who = [name for bit, name in ((stat.S_IRGRP, "its group"), (stat.S_IROTH, "every user")) if mode & bit]
    return " and ".join(who)


def exposed_key_warning(flag: str, file_flag: str, variable: str) -> str:
    return (f"warning: the key given with {flag} is visible to every user of this machine while the app runs "
            f"(ps, /proc/PID/cmdline); put it in a file only you can read and give {file_flag} PATH, or set "
            f"{variable}")
