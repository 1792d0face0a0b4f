"""Floor 4 (effects): the known-good manifest on disk: --manifest read and checked before torch, --save-manifest
written under a lock after a PASS, --diff-manifest of two files. What a manifest means is aiv/checks/manifest.py."""
import datetime
import json
import os
import sys

from ..core.base import EXIT_FAIL, EXIT_PASS, EXIT_USAGE, UsageError, finding
from ..core.files import LockTimeout, _file_lock, write_json_atomic
from ..core.speak import emit
from .manifest import (
    _hosts_in,
    diff_manifests,
    manifest_from_records,
    manifest_problem,
    manifest_refusal,
    merge_manifests,
)


def load_manifest(path, origin):
    """The manifest at path, or UsageError naming origin (the option) and the problem in one line."""
    try:
        with open(path, "rb") as f:
            text = f.read(64 << 20).decode("utf-8", errors="replace")
    except OSError as e:
        raise UsageError(f"{origin} {path}: cannot read it: {e.strerror or e}") from None
    try:
        data = json.loads(text)
    except ValueError as e:
        raise UsageError(f"{origin} {path}: not a manifest (not JSON: {e})") from None
    if problem := manifest_problem(data):
        raise UsageError(f"{origin} {path}: {problem}")
    return data


def manifest_preflight(args):
    """Rank 0 and the local launcher, before torch is imported: --manifest must be a readable manifest of a
    schema this tool reads (kept in args.manifest_data for the judge); --save-manifest's directory must
    exist and be writable, and a file already there must be a manifest to merge into. UsageError: exit 2."""
    if args.manifest:
        args.manifest_data = load_manifest(args.manifest, "--manifest")
    path = args.save_manifest
    if not path:
        return
    d = os.path.dirname(os.path.abspath(path))
    if os.path.isdir(path):
        raise UsageError(f"--save-manifest {path} is a directory; name the file to write")
    if not os.path.isdir(d):
        raise UsageError(f"--save-manifest {path}: directory {d} does not exist")
    if not os.access(d, os.W_OK | os.X_OK):
        raise UsageError(f"--save-manifest {path}: directory {d} is not writable by uid {os.getuid()}")
    if os.path.exists(path):
        load_manifest(path, "--save-manifest")


def save_manifest(path, state, written_at):
    """Merge this run's accepted state into the manifest at path (atomically, under _file_lock's bounded lock:
    state's deadlines['manifest-lock'], else MANIFEST_LOCK_S). -> the report's note. A PASS saves, its WARNs
    recorded as accepted; a FAIL never saves. A save that cannot take the lock in time or cannot write also
    adds a WARN finding to state['findings'] naming the file (no host: the nodes are not at fault)."""
    if why := manifest_refusal(state):
        return f"manifest not saved to {path}: {why}; a manifest is saved only from a PASS"
    try:
        with _file_lock(path, (state.get("deadlines") or {}).get("manifest-lock")):
            old = load_manifest(path, "--save-manifest") if os.path.exists(path) else None
            new = manifest_from_records(state.get("ranks") or [], written_at, state.get("screen"),
                                        state.get("findings") or [])
            write_json_atomic(path, merge_manifests(old, new))
    except (OSError, UsageError, LockTimeout) as e:
        note = f"manifest not saved to {path}: {e}"
        state.setdefault("findings", []).append(finding("manifest", "WARN", note))
        return note
    hosts = sum(len(_hosts_in(c["hosts"])) for c in new["classes"].values())
    warns = new["accepted_warns"]
    return (f"manifest saved to {path}: {hosts} node(s) accepted in {len(new['classes'])} class(es) "
            f"({'; '.join(new['classes'])})" + (", merged into the existing file" if old else "")
            + (f"; {len(warns)} WARN(s) accepted ({', '.join(sorted({w['check'] for w in warns}))})" if warns else ""))


def note_manifest_save(args, state):
    """Rank 0 at the verdict, with --save-manifest: save on a PASS (WARNs accepted); either way a note in the
    report, and a WARN finding when the file could not be locked or written (save_manifest)."""
    if getattr(args, "save_manifest", None):
        now = datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")
        state.setdefault("notes", []).append(save_manifest(args.save_manifest, state, now))


def run_diff_manifest(paths):
    """--diff-manifest A B (no torch): one line per difference; 0 equal, 1 different, 2 a file unusable."""
    try:
        a, b = (load_manifest(p, "--diff-manifest") for p in paths)
    except UsageError as e:
        emit(f"FAILURE: usage: {e}")
        return EXIT_USAGE
    lines = diff_manifests(a, b)
    for ln in lines:
        emit(ln)
    emit(f"diff-manifest: {len(lines)} difference(s) from {paths[0]} to {paths[1]}" if lines else
         f"diff-manifest: {paths[0]} and {paths[1]} are equal", sys.stderr)
    return EXIT_FAIL if lines else EXIT_PASS
