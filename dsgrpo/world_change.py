"""Resuming a checkpoint on another number of ranks: what cannot carry over exactly is refused first; the engine
state is converted once into DeepSpeed's universal format (collective; rank 0 converts, checksummed like the
checkpoint), and the resume says in one message what carried over exactly and what did not."""

from __future__ import annotations

import errno
import json
import os
import shutil
import sys
import time
from typing import Optional

from . import compat, dist
from .checkpoint_integrity import CHECKSUMS, _digest_share, checkpoint_files, damage
from .errors import CheckpointError

ENGINE_TAG = "engine"
UNIVERSAL_TAG = "engine_universal"  # the engine state converted for another world size (DeepSpeed's universal format)


def check_world_change(path: str, args, saved_world: int, world: int, rollout_source=None) -> None:
    """Refuse, before anything converts or loads, a world-size change this run cannot carry exactly."""
    if args.sync_ref_model:
        raise CheckpointError(
            f"{path} was written by {saved_world} rank(s) and this run has {world}: the mixed "
            "reference of sync_ref_model is saved per rank without optimizer state, which DeepSpeed's "
            f"universal conversion cannot reshard. Resume it on {saved_world} rank(s)."
        )
    if rollout_source is not None:
        rollout_source.check_world_change(args, path, saved_world, world)


def universal_engine(path: str) -> str:
    """The universal copy of checkpoint `path`'s engine state (collective over every rank): rank 0 converts once
    into `.engine_universal.partial/` and renames it into place with its own checksums.json; the other ranks wait
    on the file system (a conversion may outlast a collective's timeout). A finished copy is reused, and refused
    naming the file when it is damaged."""
    folder = os.path.join(path, UNIVERSAL_TAG)
    if os.path.realpath(folder) in _checked_universal:  # check_resume converted and checked it for this load
        return folder
    failed = os.path.join(path, f".{UNIVERSAL_TAG}.failed")
    if not os.path.isdir(folder) and not os.access(path, os.W_OK):  # the same answer on every rank
        raise CheckpointError(
            f"{path} was written by another number of ranks and must be converted once into "
            f"{folder}, but the folder is not writable. Copy the checkpoint to a writable place "
            "and resume from the copy."
        )
    if dist.is_main() and not os.path.isdir(folder) and os.path.exists(failed):
        os.remove(failed)  # an earlier attempt's
    dist.barrier("no stale conversion failure is left", group=dist.EVERYONE)
    if dist.is_main():
        if not os.path.isdir(folder):
            try:
                _convert(path, folder)
            except (OSError, RuntimeError) as exc:
                with open(failed, "w") as fh:
                    fh.write(str(exc))
    else:
        while not os.path.isdir(folder) and not os.path.exists(failed):
            time.sleep(0.5)
    dist.barrier("the universal copy is converted", group=dist.EVERYONE)
    if os.path.exists(failed):
        with open(failed) as fh:
            raise CheckpointError(
                f"{path} could not be converted for another world size: {fh.read()}. Nothing was "
                "loaded; the checkpoint is unchanged."
            )
    check_universal(folder)
    _checked_universal.add(os.path.realpath(folder))
    return folder


_checked_universal: set = set()


def _convert(path: str, folder: str) -> None:
    partial = os.path.join(path, f".{UNIVERSAL_TAG}.partial")
    shutil.rmtree(partial, ignore_errors=True)  # a conversion that was killed
    engine = os.path.join(path, ENGINE_TAG)
    need = sum(os.path.getsize(os.path.join(engine, f)) for f in checkpoint_files(engine))
    free = shutil.disk_usage(path).free
    if free < need * 1.05:
        raise OSError(
            errno.ENOSPC,
            f"no room to convert {engine}: {free / 2**20:.1f} MiB free, about {need / 2**20:.1f} MiB needed",
        )
    print(
        f"dsgrpo: converting {engine} to DeepSpeed's universal format (once) for a new world size",
        file=sys.stderr,
        flush=True,
    )
    started = time.perf_counter()
    try:
        compat.convert_to_universal(engine, partial)
        with open(os.path.join(partial, CHECKSUMS), "w") as fh:
            json.dump(dict(sorted(_digest_share(partial, 0, 1).items())), fh, indent=0)  # one process: every file
        os.rename(partial, folder)
    except BaseException:
        shutil.rmtree(partial, ignore_errors=True)
        raise
    print(f"dsgrpo: {folder} written in {time.perf_counter() - started:.1f} s", file=sys.stderr, flush=True)


def check_universal(folder: str) -> None:
    """Collective: refuse a universal copy with a missing, truncated or changed file, naming it."""
    if not os.path.isfile(os.path.join(folder, CHECKSUMS)):
        what = f"it has no {CHECKSUMS} (a conversion that did not finish, or one made by hand)"
    else:
        found = [
            d
            for d in dist.all_gather_object(
                damage(folder, dist.rank(dist.EVERYONE), dist.world_size(dist.EVERYONE)), group=dist.EVERYONE
            )
            if d
        ]
        what = found[0] if found else None
    if what:
        raise CheckpointError(
            f"{folder}, the copy of the engine state converted for another world size, is damaged: "
            f"{what}. It was not loaded. Remove {folder} and resume again to convert it anew."
        )


def world_change_note(path: str, saved_world: int, world: int, round_index: int, source_note: Optional[str]) -> str:
    """The one message of a resume on another number of ranks: what carried over exactly, and what did not."""

    def ranks(first, last):
        return f"rank {first}" if first == last else f"ranks {first}..{last}"

    if world > saved_world:
        rng = f"{ranks(saved_world, world - 1)} had no RNG state in the checkpoint and start from seed-derived streams"
    else:
        rng = (
            f"rank {world}'s RNG state is not used"
            if world == saved_world - 1
            else f"the RNG states of {ranks(world, saved_world - 1)} are not used"
        )
    return (
        f"dsgrpo: resuming {path}, written by {saved_world} rank(s), on {world}: parameters, Adam moments, "
        f"learning-rate schedule, step count, entropy control and best-checkpoint record are carried exactly "
        f"(DeepSpeed universal checkpoint); the prompt order continues at round {round_index} with the same "
        f"prompts and sampling seeds per round. Not exact: {rng} (generation is seeded per round and slot, so "
        f"sampling does not depend on them){'; ' + source_note if source_note else ''}."
    )


def _saved_world(path: str) -> int:
    with open(os.path.join(path, "trainer_state.json")) as fh:
        return json.load(fh)["identity"]["world_size"]
