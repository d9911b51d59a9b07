"""How fast this host checks an artifact's data files: each digest's pace from memory on one and on every core, and,
given an artifact, its data files checked as a start checks them (core/file_hashes.py `files_matching`) against
plain reads of the same files, in one stream and in as many as the check has in flight.

    . .venv/bin/activate && python benchmarks/file_digests.py [ART] [--cold] [--json]

  from memory   sha256 (what artifacts before format version 5 record) and BLAKE3 (what they record now) over the
                same 256 MiB buffer, on one thread and on every core (a 64 MiB chunk a thread): GB/s.
  ART           every data file the manifest lists with chunk digests, --rounds times, each round in another order,
                the best of each: read once (1 MiB reads) in one stream and in
                READS_IN_FLIGHT streams (each file in contiguous runs read side by side), then checked through
                `files_matching`; with --cold (root only) the page cache is dropped before each, so each reads
                from the disk as a first start does. The check's time over the faster read's is what the start
                pays for checking: 1.0 is a check at the disk's pace.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import blake3

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks.native_at_size import drop_page_cache, read_once  # noqa: E402
from k2deploy.core import file_hashes  # noqa: E402
from k2deploy.core.errors import K2Error  # noqa: E402
from k2deploy.core.manifest import load_manifest  # noqa: E402

BUFFER = 256 << 20
DIGESTS = {"sha256": hashlib.sha256, "blake3": blake3.blake3}


def digest_gbps(kind, threads: int, rounds: int = 3) -> float:
    """GB/s of `kind` over BUFFER bytes split in 64 MiB chunks among `threads` threads: the best of `rounds`."""
    data = memoryview(bytes(BUFFER))
    chunks = [data[at:at + file_hashes.CHUNK_BYTES] for at in range(0, BUFFER, file_hashes.CHUNK_BYTES)]
    best = float("inf")
    with ThreadPoolExecutor(max_workers=threads) as pool:
        for _ in range(rounds):
            started = time.perf_counter()
            list(pool.map(lambda chunk: kind(chunk).digest(), chunks))
            best = min(best, time.perf_counter() - started)
    return BUFFER / best / 1e9


def check_s(manifest, names: list[str], threads: int) -> float:
    started = time.perf_counter()
    found = file_hashes.files_matching([(manifest.path(n), manifest.data["files"][n]) for n in names], threads)
    if not all(found):
        raise SystemExit(f"file_digests: {names[found.index(False)]} does not match its digests in the manifest")
    return time.perf_counter() - started


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("artifact", nargs="?", type=Path, help="an artifact whose data files to check (optional)")
    parser.add_argument("--cold", action="store_true", help="drop the page cache before the read and the check "
                                                            "(root only)")
    parser.add_argument("--rounds", type=int, default=3, help="rounds of the reads and the check, each round in "
                                                              "another order; the best of each (default 3)")
    parser.add_argument("--json", action="store_true", help="print the figures as JSON")
    args = parser.parse_args()
    if args.cold and os.geteuid() != 0:
        parser.error("--cold drops the page cache, which takes root")
    if args.rounds < 1:
        parser.error("--rounds: at least 1")
    manifest = names = None
    if args.artifact:  # checked before anything is timed
        try:
            manifest = load_manifest(args.artifact, verify_hashes=False)
        except K2Error as exc:
            parser.error(str(exc))
        names = [n for n, r in manifest.data["files"].items() if file_hashes.chunk_key(r)]
        if not names:
            parser.error(f"{args.artifact}: no data file with chunk digests (exported before format version 4)")
    cores = len(os.sched_getaffinity(0))
    result = {"cores": cores, "gbps": {name: {"1 thread": digest_gbps(kind, 1), f"{cores} threads":
                                              digest_gbps(kind, cores)} for name, kind in DIGESTS.items()}}
    if manifest is not None:
        runs = [("read_1_stream_s", lambda: read_once(args.artifact, 1, names)),
                (f"read_{file_hashes.READS_IN_FLIGHT}_streams_s",
                 lambda: read_once(args.artifact, file_hashes.READS_IN_FLIGHT, names)),
                ("check_s", lambda: check_s(manifest, names, cores))]
        timings = {what: float("inf") for what, _ in runs}
        for round_ in range(args.rounds):  # each round in another order: the disk's pace drifts, and a read can
            for what, run in runs[round_ % 3:] + runs[:round_ % 3]:  # warm the host's cache for the next
                if args.cold:
                    drop_page_cache()
                timings[what] = min(timings[what], run())
        size = sum(manifest.data["files"][n]["bytes"] for n in names)
        kinds = sorted({file_hashes.chunk_key(manifest.data["files"][n]) for n in names})
        result["artifact"] = {"path": str(args.artifact), "bytes": size, "digests": kinds, "cold": args.cold,
                              **timings, "check_over_read": timings["check_s"] / min(
                                  v for k, v in timings.items() if k.startswith("read"))}
    if args.json:
        print(json.dumps(result, indent=2))
        return
    for name, pace in result["gbps"].items():
        print(f"{name:7s} " + ", ".join(f"{k}: {v:.2f} GB/s" for k, v in pace.items()))
    if "artifact" in result:
        art = result["artifact"]
        print(f"{art['path']}: {art['bytes'] / 1e9:.2f} GB of data files ({', '.join(art['digests'])}), "
              f"{'from the disk' if art['cold'] else 'as the page cache has them'}: read in one stream "
              f"{art['read_1_stream_s']:.2f} s, in {file_hashes.READS_IN_FLIGHT} streams "
              f"{art[f'read_{file_hashes.READS_IN_FLIGHT}_streams_s']:.2f} s, checked {art['check_s']:.2f} s "
              f"({art['check_over_read']:.2f}x the faster read)")


if __name__ == "__main__":
    main()
