"""Reading a student's folder without trusting it.

The grader reads submissions outside the sandbox, as its own user, so it never follows a link
and never reads without a bound:

* every path is opened one component at a time from the student's folder, each with
  ``O_NOFOLLOW``: a symlink anywhere (``labs`` pointing at ``solutions/``, a module pointing at a
  classmate's) is not followed; it is listed, with its target and whether that is outside the
  folder;
* the walk is iterative and stops ``MAX_DEPTH`` folders down and after ``MAX_ENTRIES`` entries
  (what it did not look at is listed); a file is read only if it is regular and at most
  ``MAX_FILE_BYTES``; what it keeps is bounded too (``MAX_KEPT`` links and names listed, each
  symlink's target only as far as which classmate's folder it points into);
* names are whatever the file system holds (spaces, unicode, a leading dash, bytes that are not
  UTF-8): they are paths here, never command arguments.

What the grader takes from a submission is only its exercise modules (``labs/<exercise>.py``) and
its notebooks; the other files are compared with the release and listed when they differ.
"""

from __future__ import annotations

import hashlib
import os
import stat
from dataclasses import dataclass, field
from pathlib import Path

from labs.grade.report import md_code

MAX_DEPTH = 32
MAX_ENTRIES = 20_000
MAX_FILE_BYTES = 20 << 20
MAX_KEPT = 20  # symlinks (with their targets), folders not looked at, odd files: listed ones
SKIP = {".git", "__pycache__", ".ipynb_checkpoints", ".venv", "venv", ".pytest_cache"}
DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
FILE_FLAGS = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC


class Unreadable(OSError):
    """A path of the submission that is not a regular file reachable without a link."""


@dataclass
class Scan:
    """What a walk of the student's folder found."""

    files: dict[str, os.stat_result] = field(default_factory=dict)  # regular files
    links: dict[str, str] = field(default_factory=dict)  # symlink -> target: the first MAX_KEPT
    odd: list[str] = field(default_factory=list)  # fifos, sockets, devices (the first MAX_KEPT)
    not_looked_at: list[str] = field(default_factory=list)  # too deep, past MAX_ENTRIES (same)
    counts: dict[str, int] = field(default_factory=dict)  # "links", "odd", "not_looked_at": all
    into: dict[str, list[str]] = field(default_factory=dict)  # folder beside root -> links into it

    def keep(self, kind: str, item, value=None) -> None:
        """Count one more of ``kind``; keep it if fewer than MAX_KEPT are kept."""
        self.counts[kind] = self.counts.get(kind, 0) + 1
        kept = getattr(self, kind)
        if len(kept) < MAX_KEPT:
            if isinstance(kept, dict):
                kept[item] = value
            else:
                kept.append(item)


def display(name: str) -> str:
    """A name as text that any report can hold (undecodable bytes become U+FFFD)."""
    return name.encode("utf-8", "surrogateescape").decode("utf-8", "replace")


def scan(root: Path) -> Scan:
    """Walk ``root`` (which must not itself be a link) without following any link. A link's
    target is kept for the first MAX_KEPT links; for every link, which folder beside ``root`` (a
    classmate's) it points into, if it does."""
    found = Scan()
    top = os.open(root, DIR_FLAGS)
    stack = [(top, "", 0)]
    entries = 0
    try:
        while stack and entries <= MAX_ENTRIES:
            fd, prefix, depth = stack.pop()
            try:
                with os.scandir(fd) as listing:
                    names = sorted(listing, key=lambda e: e.name)
                    for entry in names:
                        rel = prefix + entry.name
                        entries += 1
                        if entries > MAX_ENTRIES:
                            found.keep("not_looked_at", f"{prefix or './'} (past {MAX_ENTRIES})")
                            break
                        _classify(entry, rel, fd, depth, found, stack, root)
            finally:
                os.close(fd)
    finally:
        for fd, _, _ in stack:
            os.close(fd)
    return found


def _classify(
    entry: os.DirEntry, rel: str, parent: int, depth: int, found: Scan, stack, root: Path
) -> None:
    mode = entry.stat(follow_symlinks=False).st_mode
    if stat.S_ISLNK(mode):
        target = os.readlink(entry.name, dir_fd=parent)
        found.keep("links", rel, target)
        pointed = link_target(root, rel, target)
        beside = root.parent
        if pointed.is_relative_to(beside) and pointed != beside:
            other = pointed.relative_to(beside).parts[0]
            if other != root.name:
                into = found.into.setdefault(other, [])
                if len(into) < MAX_KEPT:
                    into.append(rel)
    elif stat.S_ISDIR(mode):
        if entry.name in SKIP:
            return
        if depth + 1 >= MAX_DEPTH:
            found.keep("not_looked_at", f"{rel}/ (more than {MAX_DEPTH} folders deep)")
            return
        try:
            stack.append((os.open(entry.name, DIR_FLAGS, dir_fd=parent), rel + "/", depth + 1))
        except OSError:
            found.keep("odd", rel + "/")
    elif stat.S_ISREG(mode):
        found.files[rel] = entry.stat(follow_symlinks=False)
    else:
        found.keep("odd", rel)


def read_file(root: Path, rel: str, limit: int = MAX_FILE_BYTES) -> tuple[bytes, os.stat_result]:
    """The bytes of the regular file ``rel`` under ``root``, reached with no link on the way.
    Raises ``Unreadable`` (saying why) for anything else."""
    parts = rel.split("/")
    fds = []
    try:
        fd = os.open(root, DIR_FLAGS)
        fds.append(fd)
        for part in parts[:-1]:
            fd = os.open(part, DIR_FLAGS, dir_fd=fd)
            fds.append(fd)
        fd = os.open(parts[-1], FILE_FLAGS, dir_fd=fd)
        fds.append(fd)
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode):
            raise Unreadable(f"{rel} is not a regular file")
        if info.st_size > limit:
            raise Unreadable(f"{rel} is larger than {limit >> 20} MiB")
        with os.fdopen(os.dup(fd), "rb") as f:
            data = f.read(limit + 1)
        if len(data) > limit:
            raise Unreadable(f"{rel} is larger than {limit >> 20} MiB")
        return data, info
    except Unreadable:
        raise
    except FileNotFoundError:
        raise Unreadable(f"{rel} is missing") from None
    except OSError as exc:  # ELOOP: a link on the way; ENOTDIR; EACCES ...
        why = f"{rel} cannot be read without following a link ({exc.strerror})"
        raise Unreadable(why) from None
    finally:
        for fd in fds:
            os.close(fd)


def link_notes(links: dict[str, str], root: Path) -> list[str]:
    """One Markdown line per symlink: where it points, and whether that is outside the student's
    folder (names escaped)."""
    notes = []
    for rel, target in sorted(links.items()):
        inside = os.path.normpath(os.path.join(os.path.dirname(rel), target))
        outside = os.path.isabs(target) or inside == ".." or inside.startswith("../")
        if os.path.isabs(target) and Path(target).is_relative_to(root):
            outside = False
        where = "points outside your folder" if outside else "points inside your folder"
        shown = f"{md_code(display(rel))} -> {md_code(display(target))}"
        notes.append(f"{shown}: a symlink ({where}), not followed")
    return notes


def link_target(root: Path, rel: str, target: str) -> Path:
    """Where a symlink of the submission points, as a path (not resolved further)."""
    base = root / os.path.dirname(rel)
    return Path(os.path.normpath(target if os.path.isabs(target) else base / target))


def digest(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()
