"""The ledger's spool: usage records an edge could not store when it stopped, kept
in its ``state_dir`` until an edge stores them.

An edge stopped (SIGTERM, a drain) while its ledger's database failed the last
flush (PostgreSQL unreachable, a SQLite file locked) exited with the records it
held: all lost, silently (an outside audit: 20 of 20, the log saying they were
kept). :func:`write` puts them in a file of their own there, whole or not at all;
the next edge that starts with that ``state_dir`` and a ledger claims the file
(:func:`claim`) and stores them with its first flushes, in its ledger (a file
does not say which ledger its records were for).

Files, in ``state_dir`` (one record a line: :class:`SpooledRecord`, a JSON array):

- ``ledger-spool-<ns>-<hex>.jsonl``: written (a temporary file, fsynced, renamed
  into place), waiting for an edge.
- ``….jsonl.claimed``: an edge's, locked (``flock``) until its records are stored
  (then removed) or spooled again at its stop. Renamed by the edge that locked
  it, so two edges sharing a ``state_dir`` never both take one file; the lock
  goes with an edge that died, and the next edge claims the file again (records
  it had stored meanwhile are found in the table and not stored twice:
  :func:`edge.ledger._unstored`).

A line that is not a record (a damaged or truncated file) is skipped, with a
warning: it never stops an edge from starting.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import secrets
import time
from collections.abc import Sequence
from typing import Annotated, BinaryIO

import msgspec
import structlog

log = structlog.get_logger("iop.edge.ledger")

PREFIX = "ledger-spool-"
WAITING = ".jsonl"
CLAIMED = ".claimed"  # (after WAITING)
MAX_LINE = 64 * 1024  # a record is some 200 bytes (its model name cut at 256 characters): longer is damage


# What a table's column holds (a damaged line's 2**64 failed every batch it was in, for good, as
# SQLite and PostgreSQL refused it: the ledger "unavailable", records piling up); a finite time.
Count = Annotated[int, msgspec.Meta(ge=0, le=2**63 - 1)]
Time = Annotated[float, msgspec.Meta(ge=0, le=1e15)]


class SpooledRecord(msgspec.Struct, array_like=True):
    """One usage record as the ledger's table holds it (edge.ledger's ``Record``, in its order)."""

    ts: Time
    request_id: str
    key: str | None
    model: str | None
    node: str | None
    api: str | None
    status: Annotated[int, msgspec.Meta(ge=0, le=999)] | None
    outcome: str | None
    prompt_tokens: Count
    completion_tokens: Count
    estimated: Count
    ttft_ms: Time | None
    duration_ms: Time | None


_SPOOLED = (WAITING, WAITING + CLAIMED)
_encode_lines = msgspec.json.Encoder().encode_lines
_decode = msgspec.json.Decoder(SpooledRecord).decode


def write(directory: str, records: Sequence[tuple]) -> str:
    """A new spool file of ``records`` in ``directory`` (made if missing), all of them
    or none (an OSError: a read-only directory, a full disk); its path."""
    os.makedirs(directory, exist_ok=True)
    name = f"{PREFIX}{time.time_ns()}-{secrets.token_hex(4)}{WAITING}"
    path = os.path.join(directory, name)
    temp = os.path.join(directory, f".{name}.tmp")
    try:
        with open(temp, "wb") as f:
            f.write(_encode_lines(records))
            f.flush()
            os.fsync(f.fileno())
        os.rename(temp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(temp)
        raise
    try:  # the rename itself made durable
        fd = os.open(directory, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
    except OSError:  # (a file system that cannot fsync a directory: the file is in place)
        pass
    return path


class Claimed:
    """A spool file this edge holds, locked until it is removed or released."""

    __slots__ = ("path", "file")

    def __init__(self, path: str, file: BinaryIO) -> None:
        self.path = path
        self.file = file

    def remove(self) -> None:
        """Its records are stored: the file goes. (One that cannot be removed is claimed
        again by the next edge, which finds its records stored.)"""
        try:
            os.unlink(self.path)
        except FileNotFoundError:
            pass
        except OSError as e:
            log.warning("a spool file whose records are stored could not be removed", path=self.path, error=str(e))
        self.release()

    def release(self) -> None:
        """Unlocked and left for the next edge."""
        self.file.close()


def claim(directory: str, room: int) -> tuple[list[Claimed], list[tuple]]:
    """Claim the spool files in ``directory``, oldest first, while their records fit
    in ``room`` (the ledger's buffer); the files and their records, each request id
    once (a file spooled at a stop holds those of the file its edge had claimed)."""
    try:
        names = sorted(n for n in os.listdir(directory) if n.startswith(PREFIX) and n.endswith(_SPOOLED))
    except FileNotFoundError:
        return [], []
    except OSError as e:
        log.warning("the ledger's spool directory cannot be read", path=directory, error=str(e))
        return [], []
    claimed: list[Claimed] = []
    records: list[tuple] = []
    seen: set[str] = set()
    for name in names:
        path = os.path.join(directory, name)
        try:
            file = open(path, "rb")  # noqa: SIM115  (held, locked, while its records wait: Claimed)
        except FileNotFoundError:  # claimed by another edge since the listing
            continue
        except OSError as e:
            log.warning("a spool file cannot be read; left as it is", path=path, error=str(e))
            continue
        try:
            fcntl.flock(file, fcntl.LOCK_EX | fcntl.LOCK_NB)
            if os.stat(path).st_ino != os.fstat(file.fileno()).st_ino:
                raise FileNotFoundError(path)  # stored and removed by the edge that held the lock
            got, bad = _read(file, room - len(records))
            if got is not None and name.endswith(WAITING):
                os.rename(path, path + CLAIMED)
                path += CLAIMED
        except (BlockingIOError, FileNotFoundError):  # another edge's (it holds the lock), or gone
            file.close()
            continue
        except OSError as e:  # (a read-only state_dir: it is not renamed)
            file.close()
            log.warning("a spool file cannot be claimed; left as it is", path=path, error=str(e))
            continue
        if bad:
            log.warning("spool file: lines that are not records skipped", path=path, lines=bad)
        if got is None:  # (not one that blocks the files after it: a file too large for any room did)
            file.close()
            log.info("spool file left for later: the ledger's buffer has no room for it now", path=path)
            continue
        claimed.append(Claimed(path, file))
        for rec in got:
            if rec[1] not in seen:
                seen.add(rec[1])
                records.append(rec)
    return claimed, records


def _read(file: BinaryIO, room: int) -> tuple[list[tuple] | None, int]:
    """The records of a spool file and the count of lines that are not records; None
    for the records if there are more than ``room``."""
    records: list[tuple] = []
    bad = 0
    while line := file.readline(MAX_LINE + 1):
        if len(line) > MAX_LINE and not line.endswith(b"\n"):  # (read to its end, bounded)
            bad += 1
            while line and not line.endswith(b"\n"):
                line = file.readline(MAX_LINE + 1)
            continue
        if not line.strip():
            continue
        try:
            rec = msgspec.structs.astuple(_decode(line))
        except msgspec.DecodeError:  # (a ValidationError too: a line cut short, or damaged)
            bad += 1
            continue
        if len(records) == room:
            return None, bad
        records.append(rec)
    return records, bad
