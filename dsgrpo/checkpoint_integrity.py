"""A checkpoint's integrity: checksums.json (size and sha256 of every file, each rank hashing a share) written
with it, and checked before anything of it is read, so a truncated shard or a changed byte is refused naming the
file."""

from __future__ import annotations

import hashlib
import json
import os
import sys
from typing import Any, Dict, List, Optional

from . import dist
from .errors import CheckpointError

COMPLETE = "COMPLETE"
CHECKSUMS = "checksums.json"


def checkpoint_files(folder: str) -> List[str]:
    """Every file of a checkpoint but its checksums and marker, as sorted paths relative to it."""
    out = []
    for root, _, names in os.walk(folder):
        for name in names:
            rel = os.path.relpath(os.path.join(root, name), folder)
            if rel not in (CHECKSUMS, COMPLETE):
                out.append(rel)
    return sorted(out)


def sha256(path: str) -> str:
    with open(path, "rb") as fh:
        return hashlib.file_digest(fh, "sha256").hexdigest()


def _digest_share(folder: str, rank: int, world: int) -> Dict[str, Dict[str, Any]]:
    """This rank's share of the files (every world-th, by size so shares weigh alike): {path: {size, sha256}}."""
    files = sorted(checkpoint_files(folder), key=lambda f: -os.path.getsize(os.path.join(folder, f)))
    return {
        f: {"size": os.path.getsize(os.path.join(folder, f)), "sha256": sha256(os.path.join(folder, f))}
        for f in files[rank::world]
    }


def damage(path: str, rank: int = 0, world: int = 1) -> Optional[str]:
    """What is wrong with a checkpoint's files against its checksums.json (sizes of all; sha256 of this rank's
    share), or None when intact. A checkpoint written before checksums existed has none to check."""
    manifest = os.path.join(path, CHECKSUMS)
    if not os.path.isfile(manifest):
        return None
    try:
        with open(manifest) as fh:
            expected = json.load(fh)
    except (OSError, ValueError) as exc:
        return f"{CHECKSUMS} cannot be read ({exc})"
    present = set(checkpoint_files(path))
    for name in sorted(expected):
        if name not in present:
            return f"{name} is missing"
        size = os.path.getsize(os.path.join(path, name))
        if size != expected[name]["size"]:
            return f"{name} has {size} bytes, {expected[name]['size']} were written (truncated or overwritten)"
    for name in sorted(expected, key=lambda f: -expected[f]["size"])[rank::world]:
        if sha256(os.path.join(path, name)) != expected[name]["sha256"]:
            return f"{name} does not match its sha256 (the file changed after it was written)"
    return None


def check_intact(path: str) -> None:
    """Collective when a process group exists: refuse a damaged checkpoint, naming the file, on every rank."""
    if not os.path.isfile(os.path.join(path, CHECKSUMS)):
        if dist.is_main():
            print(
                f"dsgrpo: {path} has no {CHECKSUMS} (written by an older dsgrpo): resuming without checking it",
                file=sys.stderr,
                flush=True,
            )
        return
    found = [
        d
        for d in dist.all_gather_object(
            damage(path, dist.rank(dist.EVERYONE), dist.world_size(dist.EVERYONE)), group=dist.EVERYONE
        )
        if d
    ]
    if found:
        raise DamagedCheckpointError(path, found[0])


class DamagedCheckpointError(CheckpointError):
    def __init__(self, path: str, what: str):
        self.path, self.what = path, what
        super().__init__(
            f"{path} is damaged: {what}. It was not loaded. Resume from an older checkpoint "
            "(resume_from_checkpoint=PATH) or start a new output_dir."
        )
